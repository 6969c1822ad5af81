"""One generation as the gateway sees it: a Generator's token events turned into text.

    GenerationRequest ─▶ Generator.generate ─▶ TokenEvent… Finished
        ─▶ StreamDecoder (whole UTF-8 characters) ─▶ StopMatcher (held-back partial stops)
        ─▶ Piece… Done        (rendered by openai.py or anthropic.py)

Leaving the loop early (a stop sequence, a client disconnect) closes the Generator's
stream, which frees its KV cache.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from kvasird.gateway.stops import StopMatcher
from kvasird.inference.api import Finished, GenerationRequest, Generator, TokenEvent
from kvasird.inference.tokenizer import Tokenizer


@dataclass(frozen=True)
class Piece:
    text: str
    """Text safe to send (whole characters, nothing that may start a stop sequence)."""
    tokens: tuple[TokenEvent, ...]
    """The tokens consumed since the previous piece (for logprobs)."""


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


async def pieces(generator: Generator, tokenizer: Tokenizer, request: GenerationRequest,
                 stops: tuple[str, ...]) -> AsyncGenerator[Piece | Done, None]:
    decoder, matcher = tokenizer.stream(), StopMatcher(stops)
    pending: list[TokenEvent] = []
    produced = 0
    async with _closing(generator.generate(request)) as events:
        async for event in events:
            if isinstance(event, Finished):
                tail, hit = matcher.feed(decoder.finish())
                tail += "" if hit else matcher.flush()
                if tail or pending:
                    yield Piece(tail, tuple(pending))
                reason = "stop_sequence" if hit else event.reason
                yield Done(reason, hit, event.prompt_tokens, event.completion_tokens)
                return
            pending.append(event)
            produced += 1
            text, hit = matcher.feed(decoder.feed(event.token))
            if hit is not None:
                yield Piece(text, tuple(pending))
                yield Done("stop_sequence", hit, len(request.prompt), produced)
                return
            if text:
                yield Piece(text, tuple(pending))
                pending = []


@asynccontextmanager
async def _closing(events: AsyncIterator[TokenEvent | Finished]
                   ) -> AsyncIterator[AsyncIterator[TokenEvent | Finished]]:
    """Close the Generator's stream when we leave (the protocol promises an async iterator;
    async generators, the usual implementation, free their KV cache in aclose)."""
    try:
        yield events
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
