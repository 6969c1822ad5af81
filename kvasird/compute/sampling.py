"""Turning the head's logits into the next token: greedy, or seeded random sampling.

The stage holding the head samples, so only a token id travels back to the gateway.
Order of the transforms (as llama.cpp and HF apply them): the grammar's mask (tokens it
does not allow get -inf), repetition penalty, then temperature, top-k, top-p, draw.
Temperature 0 is greedy. A sampler with a seed draws the same tokens for the same logits
every time, on every node: a replayed generation after failover reproduces its tokens
(its constraint catches up on the tokens of the history it did not draw itself).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvasird.compute.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings, validated on construction: the one sampling type
    from the gateway's API to the sampler at the head (kvasird.inference.protocol.stage
    holds its wire form)."""

    temperature: float = 0.0
    """0 = greedy (argmax); otherwise logits are divided by it before the softmax."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = no limit."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 = no limit."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in the history (positive logits divided, negative
    multiplied)."""
    seed: int | None = None
    """Seed of the draw, 0..2^64-1 (it travels to the head in a 64-bit field); None =
    fresh entropy (a swarm generation draws one, so that every route it takes agrees)."""
    grammar: str = ""
    """A grammar the output must follow (kvasird.text.grammar: llguidance's JSON form,
    e.g. of a JSON schema); "" = none. Compiled where the head samples."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise InputError(f"seed must be in 0..2^64-1, got {self.seed}")
        if len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise InputError(
                f"grammar of {len(self.grammar)} characters exceeds {MAX_GRAMMAR_CHARS}"
            )


MAX_GRAMMAR_CHARS = 256 * 1024


class Constraint(Protocol):
    """What a sampler needs of a grammar (kvasird.text.grammar.Constraint)."""

    def allowed(self, generated: Sequence[int]) -> np.ndarray:
        """The tokens the grammar allows next (bool per vocabulary id), once it has
        consumed every token of ``generated`` (those drawn so far, or replayed)."""
        ...

    def consume(self, token: int) -> None:
        """``token`` was drawn."""
        ...


class Sampler:
    """Draws tokens for one generation; holds the seeded random state between steps."""

    def __init__(
        self,
        params: SamplingParams = SamplingParams(),
        constraint: Constraint | None = None,
        prompt: int = 0,
    ) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self.constraint = constraint
        self.prompt = prompt
        """Positions of the history that are the prompt: what follows is the output the
        constraint checks."""

    def skip(self, draws: int) -> None:
        """Advance the seeded stream by ``draws`` draws (a replay continues it where the
        failed route stopped), without touching the constraint."""
        for _ in range(draws):
            self._draw(np.zeros(2), ())

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        if self.constraint is None:
            return self._draw(logits, history)
        allowed = self.constraint.allowed(history[self.prompt :])
        z = np.asarray(logits).reshape(-1)
        if allowed.size > z.size:
            raise InputError(
                f"the grammar's vocabulary has {allowed.size} tokens, the logits {z.size}"
            )
        if allowed.size < z.size:  # an output padded past the tokenizer's vocabulary
            allowed = np.concatenate([allowed, np.zeros(z.size - allowed.size, bool)])
        token = self._draw(np.where(allowed, z, -np.inf), history, masked=True)
        self.constraint.consume(token)
        return token

    def _draw(self, logits: np.ndarray, history: Iterable[int], masked: bool = False) -> int:
        p = self.params
        if p.temperature == 0 and p.repetition_penalty == 1.0:
            # greedy: argmax returns the first NaN when there is one, and +inf is not finite
            z = np.asarray(logits).reshape(-1)
            best = int(np.argmax(z)) if z.size else -1
            if best < 0 or not np.isfinite(z[best]):
                raise InputError(
                    "logits must be a non-empty vector of finite numbers"
                    + (" that the grammar allows" if masked else "")
                )
            return best
        z = np.array(logits, dtype=np.float64).reshape(-1)
        if (
            z.size == 0
            or not (np.isfinite(z) | (masked & (z == -np.inf))).all()
            or not np.isfinite(z).any()
        ):
            raise InputError("logits must be a non-empty vector of finite numbers")
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.fromiter(history, dtype=np.int64))
            seen = seen[(seen >= 0) & (seen < z.size)]
            z[seen] = np.where(
                z[seen] > 0, z[seen] / p.repetition_penalty, z[seen] * p.repetition_penalty
            )
        if p.temperature == 0:
            return int(np.argmax(z))
        order = np.argsort(-z, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        probs = softmax(z[order] / p.temperature)
        if p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self._rng.choice(len(order), p=probs)])


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities (float64), for requests that ask for logprobs."""
    z = np.asarray(logits, np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
