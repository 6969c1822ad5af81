"""The generation contract: what the gateway asks for and the events it gets back.

The gateway tokenizes, applies the chat template and detects text-level stop sequences;
a Generator only ever sees token ids. Events are plain frozen values so the same stream
can be rendered as OpenAI chunks, Anthropic events, or a CLI's output. The sampler's
settings (SamplingParams, the engine's type) are part of the contract and are taken from
here: whoever asks for a generation reaches the engine only through this module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvasird.compute.sampling import LLAMA_SERVER, Recommended, SamplingParams
from kvasird.errors import KvasirError
from kvasird.model.names import named_by


class GenerationError(KvasirError):
    """A generation could not start or was cut short."""


class NoRoute(GenerationError):
    """No set of live peers covers the model right now (HTTP 503)."""


class Busy(GenerationError):
    """The route exists but has no capacity left, e.g. KV cache full everywhere (HTTP 429)."""


class UnknownModel(GenerationError):
    """No model by that id or label is known (HTTP 404)."""


class NotServed(GenerationError):
    """The network's peers refuse to work for this gateway (it is not staked, or does not
    pay them); the message carries their reason (HTTP 503)."""


@dataclass(frozen=True)
class Sampling:
    """How a generation picks its tokens, how many, and what it reports of them."""

    params: SamplingParams = SamplingParams()
    """The sampler's settings (greedy by default: each API sets its own defaults)."""
    max_tokens: int = 256
    """Upper bound on generated tokens (finish reason "length")."""
    logprobs: int = 0
    """How many top alternatives to report per token (0 = none; the chosen token's
    logprob is reported whenever this is > 0)."""


@dataclass(frozen=True)
class GenerationRequest:
    model: str
    """Model id (hex) or its name."""
    prompt: tuple[int, ...]
    """Prompt token ids (chat template already applied)."""
    sampling: Sampling = field(default_factory=Sampling)
    """How to pick tokens."""
    stop_tokens: frozenset[int] = frozenset()
    """Token ids that end the generation (EOS, end-of-turn); not emitted."""
    request_id: str = ""
    """Caller's id for logs and receipts."""


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    """Model id (hex) or its name."""
    inputs: tuple[tuple[int, ...], ...]
    """Token ids of each input (embedded separately)."""
    request_id: str = ""
    """Caller's id for logs and receipts."""


def check_embedding_input(ids: tuple[int, ...], context: int) -> None:
    """An input an embedding can be computed for: at least one token, within the context."""
    if not ids:
        raise Busy("an input to embed is empty: send at least one token of text")
    if len(ids) > context:
        raise Busy(
            f"an input of {len(ids)} tokens exceeds the model's context of {context}: "
            "split it into shorter pieces"
        )


@dataclass(frozen=True)
class TokenEvent:
    token: int
    """The sampled token id."""
    logprob: float | None = None
    """Its log probability, when asked for."""
    top: tuple[tuple[int, float], ...] = ()
    """The top alternatives (token id, logprob), when asked for."""


@dataclass(frozen=True)
class Finished:
    reason: str
    """"stop" (a stop token), "length" (max_tokens) or "cancelled"."""
    prompt_tokens: int
    """Tokens in the prompt."""
    completion_tokens: int
    """Tokens generated."""
    cached_tokens: int = 0
    """Prompt tokens the route did not compute: it started from their kept KV (prefix reuse)."""


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    """sha256 of the manifest (hex)."""
    label: str
    """Its name on the network ("smollm2:135m-instruct": model.names), the same on every
    node: what /v1/models lists as the model's ``id``."""
    context_length: int
    """Longest prompt + completion the route accepts."""
    sampling: Recommended = LLAMA_SERVER
    """What a request that leaves temperature, top-k, top-p or min-p unset samples with
    (the GGUF's recommendation, else llama-server's defaults)."""

    def answers_to(self, name: str) -> bool:
        """Whether a request naming `name` means this model: its name, its id, an id prefix
        of 8+ hex digits, or the name's slug ("smollm2-135m-instruct", what requests
        carried before names were ``family:tag``)."""
        return named_by(name, self.model_id, self.label)


@dataclass(frozen=True)
class HopWork:
    """Work one peer did for one generation, as the generating node measured it."""

    peer: str
    """The peer (authenticated by its connection, not by anything it said)."""
    units: int
    """Stages: positions computed x layers run (the head counting as one); expert
    workers: the experts their rows selected, as the stage that sent the rows counted."""
    ms_per_token: float
    """Its time per token as this node timed it (expert workers: their stage's step)."""


class Generator(Protocol):
    """Anything that turns a GenerationRequest into events: a local engine or a swarm route.

    ``generate`` yields TokenEvents then exactly one Finished; it raises NoRoute, Busy or
    UnknownModel before the first event when it cannot start. Cancelling the consumer
    (client disconnect) must free every KV cache the generation holds.
    """

    def models(self) -> list[ModelInfo]: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | Finished]: ...

    def work(self, request_id: str) -> tuple[HopWork, ...]:
        """Who did the work of a finished generation, and how much (asked once, after its
        stream closed; empty when unknown)."""
        ...

    async def embed(self, request: EmbeddingRequest) -> list[np.ndarray]:
        """Per input, every position's hidden state after the model's final norm (float32
        [T, n_embd]): what llama.cpp pools into an embedding. Raises as ``generate`` does
        before it starts; the work is reported by ``work(request.request_id)``."""
        ...
