"""Turning the head's logits into the next token: greedy, or seeded random sampling.

The stage holding the head samples, so only a token id travels back to the gateway.
Order of the transforms, llama.cpp's (src/llama-sampler.cpp, its chain as
common/sampling.cpp builds it): the grammar's mask (tokens it does not allow get -inf), the
logit bias, the penalties (repetition, frequency, presence), top-k, top-p, min-p, then
temperature and the draw. Temperature 0 is greedy. The bias and the penalties are computed
in float32 as llama.cpp computes them, so a greedy run equals llama.cpp's with the same
settings; top-p and min-p keep tokens by the probabilities before the temperature, as
llama.cpp's do, so a temperature below 1 sharpens only what they kept.

The penalties count the last ``penalty_last_n`` tokens of the history, prompt
included: llama-server feeds the prompt to its penalty sampler before the first draw, and
64 is its default window; a window also keeps a long conversation's common tokens (spaces,
punctuation) from being penalised without end. A sampler with a seed draws the same
tokens for the same logits every time, on every node: a replayed generation after failover
reproduces its tokens (its constraint catches up on the tokens of the history it did not
draw itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvasird.compute.errors import InputError

PENALTY_LAST_N = 64
"""llama-server's default penalty window (``repeat_last_n``)."""
MAX_PENALTY_LAST_N = (1 << 31) - 1
"""llama-server's bound on ``repeat_last_n``; a window past the history counts it all."""
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_LOGIT_BIAS = 1 << 20
"""Most tokens one request may bias: more than a vocabulary holds, so a request may bias
each token once (a gateway checks the ids against its model's vocabulary)."""


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
    """>1 discourages tokens in the penalty window (positive logits divided, negative
    multiplied)."""
    seed: int | None = None
    """Seed of the draw, 0..2^64-1 (it travels to the head in a 64-bit field); None =
    fresh entropy (a swarm generation draws one, so that every route it takes agrees)."""
    grammar: str = ""
    """A grammar the output must follow (kvasird.text.grammar: llguidance's JSON form,
    e.g. of a JSON schema); "" = none. Compiled where the head samples."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for each time it occurs in the penalty window
    (OpenAI's, -2..2): >0 discourages repeating a token the more it was said."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token in the penalty window (OpenAI's,
    -2..2): >0 steers towards tokens not said yet, <0 towards those said."""
    penalty_last_n: int = PENALTY_LAST_N
    """How many tokens at the end of the history (prompt and output) the three penalties
    count: llama-server's ``repeat_last_n``; 0 turns the penalties off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value) pairs, each id once, added to those tokens' logits before anything
    else (OpenAI's ``logit_bias``, values -100..100: -100 all but bans a token, 100 all but
    forces it). Ids past the logits' vocabulary are ignored, as llama.cpp ignores them."""
    min_p: float = 0.0
    """Keep only tokens at least min_p times as likely as the likeliest (llama.cpp's min-p,
    0..1); 0 = no limit. It cuts the long tail that a small model at temperature 1 would
    otherwise wander into, however flat the head of the distribution."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise InputError(
                    f"{name} must be in -{MAX_PENALTY:g}..{MAX_PENALTY:g}, got {value}"
                )
        if not 0 <= self.penalty_last_n <= MAX_PENALTY_LAST_N:
            raise InputError(
                f"penalty_last_n must be in 0..{MAX_PENALTY_LAST_N}, got {self.penalty_last_n}"
            )
        _check_logit_bias(self.logit_bias)
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise InputError(f"seed must be in 0..2^64-1, got {self.seed}")
        if len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise InputError(
                f"grammar of {len(self.grammar)} characters exceeds {MAX_GRAMMAR_CHARS}"
            )

    @property
    def penalises(self) -> bool:
        """Whether any penalty moves a logit (llama.cpp skips its penalty sampler otherwise)."""
        return self.penalty_last_n > 0 and (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


MAX_GRAMMAR_CHARS = 256 * 1024


@dataclass(frozen=True)
class Recommended:
    """What a request that leaves them unset samples with: llama-server's defaults, or
    those the model's GGUF recommends (``general.sampling.*``, as llama.cpp reads them).

    A client of an open model's server gets these, not OpenAI's temperature 1 over the
    whole vocabulary: at 1 with no cut, a 135M model wanders into the tail now and then
    (a forced tool call's string argument once in 100 runs never closed)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05

    @classmethod
    def of(cls, meta: Callable[[str], Any]) -> Recommended:
        """From a GGUF's metadata (``meta(key)``: its value or None); a value missing, of
        the wrong type or out of range leaves llama-server's."""
        base = cls()

        def number(key: str, lo: float, hi: float, default: float) -> float:
            v = meta(f"general.sampling.{key}")
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            return float(v) if ok and math.isfinite(v) and lo <= v <= hi else default

        top_k = number("top_k", 0, 1 << 20, base.top_k)
        return cls(
            temperature=number("temp", 0, 2, base.temperature),
            top_k=int(top_k) if top_k == int(top_k) else base.top_k,
            top_p=number("top_p", 1e-6, 1, base.top_p),
            min_p=number("min_p", 0, 1, base.min_p),
        )


LLAMA_SERVER = Recommended()
"""llama-server's defaults: what a model whose GGUF recommends nothing samples with."""


def _check_logit_bias(pairs: tuple[tuple[int, float], ...]) -> None:
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InputError(f"logit_bias of {len(pairs)} tokens exceeds {MAX_LOGIT_BIAS}")
    seen: set[int] = set()
    for token, value in pairs:
        if type(token) is not int or token < 0:
            raise InputError(f"logit_bias: token ids are integers >= 0, got {token!r:.40}")
        if token in seen:
            raise InputError(f"logit_bias: token {token} is biased twice")
        seen.add(token)
        if not (
            type(value) in (int, float) and math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS
        ):
            raise InputError(
                f"logit_bias: the value for token {token} must be in "
                f"-{MAX_BIAS:g}..{MAX_BIAS:g}, got {value}"
            )


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
        self._bias_ids = np.array([t for t, _ in params.logit_bias], np.int64)
        self._bias = np.array([v for _, v in params.logit_bias], np.float32)

    def skip(self, draws: int) -> None:
        """Advance the seeded stream by ``draws`` draws (a replay continues it where the
        failed route stopped), without touching the constraint."""
        for _ in range(draws):
            self._draw(np.zeros(2), ())

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The token drawn from ``logits``, the row that follows ``history``: every token
        of the sequence before that row, the prompt's and each one drawn since (the
        penalties count its end, the grammar what follows the prompt). One call is one
        draw: it advances the seeded stream and the grammar by the token it returns and
        keeps nothing else, so drawing from several rows of one step (speculative
        decoding) is one call per row, each with the previous row's token appended to
        ``history``, and gives the tokens that one step per row gives."""
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

    def _draw(self, logits: np.ndarray, history: Sequence[int], masked: bool = False) -> int:
        p = self.params
        if p.temperature == 0 and not p.penalises and not p.logit_bias:
            # greedy: argmax returns the first NaN when there is one, and +inf is not finite
            z = np.asarray(logits).reshape(-1)
            best = int(np.argmax(z)) if z.size else -1
            if best < 0 or not np.isfinite(z[best]):
                raise InputError(
                    "logits must be a non-empty vector of finite numbers"
                    + (" that the grammar allows" if masked else "")
                )
            return best
        z = np.array(logits, dtype=np.float32).reshape(-1)
        if (
            z.size == 0
            or not (np.isfinite(z) | (masked & (z == -np.inf))).all()
            or not np.isfinite(z).any()
        ):
            raise InputError("logits must be a non-empty vector of finite numbers")
        self._adjust(z, history)
        if p.temperature == 0:
            return int(np.argmax(z))
        order = np.argsort(-z, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        if p.top_p < 1 or p.min_p > 0:
            probs = softmax(z[order].astype(np.float64))
            keep = len(order)
            if p.top_p < 1:
                keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            if p.min_p > 0:  # sorted: the tokens kept are a prefix, the likeliest always
                keep = min(keep, max(int((probs >= p.min_p * probs[0]).sum()), 1))
            order = order[:keep]
        probs = softmax(z[order].astype(np.float64) / p.temperature)
        return int(order[self._rng.choice(len(order), p=probs)])

    def _adjust(self, z: np.ndarray, history: Sequence[int]) -> None:
        """The logit bias, then the penalties, on float32 logits in place, as llama.cpp's
        logit-bias and penalties samplers compute them."""
        p = self.params
        inside = self._bias_ids < z.size
        z[self._bias_ids[inside]] += self._bias[inside]
        if not p.penalises:
            return
        window = np.asarray(history[-p.penalty_last_n :], np.int64)
        ids, counts = np.unique(window, return_counts=True)
        inside = (ids >= 0) & (ids < z.size)
        ids, n = ids[inside], counts[inside].astype(np.float32)
        seen, repeat = z[ids], np.float32(p.repetition_penalty)
        seen = np.where(seen <= 0, seen * repeat, seen / repeat)
        z[ids] = seen - (n * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities (float64), for requests that ask for logprobs."""
    z = np.asarray(logits, np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
