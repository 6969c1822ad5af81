"""One generation as the gateway sees it: a Generator's token events turned into text.

    GenerationRequest ─▶ Generator.generate ─▶ TokenEvent… Finished
        ─▶ Decoder (whole UTF-8 characters) ─▶ StopMatcher (held-back partial stops)
        ─▶ Piece… Done        (rendered by openai.py or anthropic.py)

The special tokens a model writes are dropped from the text, but for the markers its chat
format reads replies by (harmony's ``<|channel|>``...:
kvasird.text.toolcalls.hermes.Format.markers), which are kept as their text. The
end-of-generation token is never in it: the Generator stops there without handing it on.

A request for n choices (OpenAI's ``n``) is n such generations, run side by side
(``produce``, one task each), their pieces tagged with the choice's index. Leaving the
loop early (a stop sequence, a client disconnect) closes the Generator's stream, which
frees its KV cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import trio

from kvasird.errors import KvasirError
from kvasird.gateway.stops import StopMatcher
from kvasird.inference.api import Finished, GenerationRequest, Generator, TokenEvent
from kvasird.text.tokenizer import Tokenizer
from kvasird.text.toolcalls.registry import format_of


@dataclass(frozen=True)
class Piece:
    text: str
    """Text safe to send (whole characters, nothing that may start a stop sequence)."""
    tokens: tuple[TokenEvent, ...]
    """The tokens consumed since the previous piece (for logprobs)."""
    index: int = 0
    """The choice it belongs to."""


@dataclass(frozen=True)
class Done:
    reason: str
    """"stop" (end-of-turn token), "length" (max_tokens) or "stop_sequence"."""
    stop_sequence: str | None
    """The stop sequence that matched, for reason "stop_sequence"."""
    prompt_tokens: int
    """Tokens in the prompt."""
    completion_tokens: int
    """Tokens generated (and consumed), the end-of-turn token excluded."""
    index: int = 0
    """The choice that ended."""
    cached_tokens: int = 0
    """Prompt tokens started from kept KV instead of computed (prefix reuse)."""


@dataclass(frozen=True)
class Choice:
    """One choice, generated whole."""

    text: str
    """Its text."""
    tokens: tuple[TokenEvent, ...]
    """Its tokens (for logprobs)."""
    done: Done
    """How it ended."""


def for_choice(request: GenerationRequest, index: int) -> GenerationRequest:
    """The generation of choice ``index`` of ``request``: choice 0 is the request itself,
    each later one has its own id (a generator keys its sessions by it) and, when the
    request is seeded, a seed derived from that seed and the index: the request is
    reproducible and its choices still differ. Greedy choices are all alike."""
    if index == 0:
        return request
    params = request.sampling.params
    if params.seed is not None:
        digest = hashlib.blake2b(f"{params.seed}/{index}".encode(), digest_size=8).digest()
        params = dataclasses.replace(params, seed=int.from_bytes(digest, "little"))
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}-{index}",
        sampling=dataclasses.replace(request.sampling, params=params),
    )


async def produce(
    generator: Generator,
    tokenizer: Tokenizer,
    request: GenerationRequest,
    stops: tuple[str, ...],
    index: int,
    out: trio.MemorySendChannel[Piece | Done | KvasirError],
) -> None:
    """Send one choice's pieces and its Done to ``out``, or the error that ended it."""
    async with out, aclosing(pieces(generator, tokenizer, request, stops, index)) as items:
        try:
            async for item in items:
                await out.send(item)
        except KvasirError as exc:
            await out.send(exc)


async def pieces(
    generator: Generator,
    tokenizer: Tokenizer,
    request: GenerationRequest,
    stops: tuple[str, ...],
    index: int = 0,
) -> AsyncGenerator[Piece | Done, None]:
    decoder, matcher = Decoder(tokenizer), StopMatcher(stops)
    pending: list[TokenEvent] = []
    produced = 0
    async with _closing(generator.generate(request)) as events:
        async for event in events:
            if isinstance(event, Finished):
                tail, hit = matcher.feed(decoder.finish())
                tail += "" if hit else matcher.flush()
                if tail or pending:
                    yield Piece(tail, tuple(pending), index)
                reason = "stop_sequence" if hit else event.reason
                yield Done(
                    reason,
                    hit,
                    event.prompt_tokens,
                    event.completion_tokens,
                    index,
                    event.cached_tokens,
                )
                return
            pending.append(event)
            produced += 1
            text, hit = matcher.feed(decoder.feed(event.token))
            if hit is not None:
                yield Piece(text, tuple(pending), index)
                yield Done("stop_sequence", hit, len(request.prompt), produced, index)
                return
            if text:
                yield Piece(text, tuple(pending), index)
                pending = []


class Decoder:
    """A generation's tokens -> text, keeping the control tokens the model's chat format
    reads (``Format.markers``) and dropping the others (user-defined ones are text)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._stream = tokenizer.stream(skip_special=False)
        self._kept = format_of(tokenizer.chat_template).markers

    def feed(self, token: int) -> str:
        if self._tok.is_control(token) and self._tok.tokens[token] not in self._kept:
            return ""
        return self._stream.feed(token)

    def finish(self) -> str:
        return self._stream.finish()


@asynccontextmanager
async def _closing(
    events: AsyncIterator[TokenEvent | Finished],
) -> AsyncIterator[AsyncIterator[TokenEvent | Finished]]:
    """Close the Generator's stream when we leave (the protocol promises an async iterator;
    async generators, the usual implementation, free their KV cache in aclose)."""
    try:
        yield events
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
