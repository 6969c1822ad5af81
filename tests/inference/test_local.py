"""LocalGenerator over the bundled model: the Generator contract, fairness, cancellation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import pytest
import trio

from kvasird.compute.sampling import Sampler, SamplingParams
from kvasird.compute.stage import generate
from kvasird.inference.api import (
    Busy,
    Finished,
    GenerationRequest,
    Sampling,
    TokenEvent,
    UnknownModel,
)
from kvasird.inference.local import LocalGenerator
from kvasird.model.bundled import bundled_path
from kvasird.text.tokenizer import Tokenizer

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
MODEL = "test-model-id"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_path())


@pytest.fixture(scope="module")
def local() -> Iterator[LocalGenerator]:
    gen = LocalGenerator.open(bundled_path(), MODEL, "smollm2", threads=1, kv_tokens=1024)
    yield gen
    gen.close()


def request(tok: Tokenizer, n: int, logprobs: int = 0, **params: Any) -> GenerationRequest:
    return GenerationRequest(MODEL, tuple(tok.encode(PROMPT, special=True)),
                             Sampling(SamplingParams(**params), n, logprobs),
                             stop_tokens=tok.special.end_of_generation)


async def collect(events: AsyncIterator[TokenEvent | Finished]) -> tuple[list[int], Finished]:
    tokens = []
    async for event in events:
        if isinstance(event, Finished):
            return tokens, event
        tokens.append(event.token)
    raise AssertionError("the stream ended without Finished")


async def test_greedy_tokens_equal_the_engines_own_generate(local: LocalGenerator,
                                                            tok: Tokenizer) -> None:
    req = request(tok, 12, temperature=0.0)
    tokens, done = await collect(local.generate(req))
    expected = generate(local.stage, req.prompt, 12, Sampler(SamplingParams()),
                        stop=req.stop_tokens)
    assert tokens == [t for t in expected if t not in req.stop_tokens]
    assert tok.decode(tokens) == "The capital of France is Paris."
    assert (done.reason, done.prompt_tokens, done.completion_tokens) == (
        "stop", len(req.prompt), len(tokens))


async def test_max_tokens_ends_with_length(local: LocalGenerator, tok: Tokenizer) -> None:
    tokens, done = await collect(local.generate(request(tok, 3, temperature=0.0)))
    assert len(tokens) == 3 and done.reason == "length" and done.completion_tokens == 3


async def test_the_same_seed_draws_the_same_tokens(local: LocalGenerator, tok: Tokenizer) -> None:
    runs = [await collect(local.generate(request(tok, 8, temperature=1.0, seed=11)))
            for _ in range(2)]
    assert runs[0][0] == runs[1][0]


async def test_logprobs_report_the_chosen_token_and_the_top_alternatives(
        local: LocalGenerator, tok: Tokenizer) -> None:
    events = [e async for e in local.generate(request(tok, 3, temperature=0.0, logprobs=3))]
    for e in events[:-1]:
        assert isinstance(e, TokenEvent) and len(e.top) == 3
        assert e.top[0][0] == e.token and e.logprob == pytest.approx(e.top[0][1])
        assert e.logprob is not None and e.logprob <= 0


async def test_unknown_model_is_refused_before_any_event(local: LocalGenerator,
                                                         tok: Tokenizer) -> None:
    req = GenerationRequest("another-model", (1, 2, 3))
    with pytest.raises(UnknownModel):
        await collect(local.generate(req))


async def test_a_request_the_kv_cache_cannot_promise_is_busy(local: LocalGenerator,
                                                             tok: Tokenizer) -> None:
    big = request(tok, 900, temperature=0.0)
    async with trio.open_nursery() as nursery:
        started = trio.Event()

        async def hold() -> None:
            async with aclosing(local.generate(big)) as events:
                async for _ in events:
                    started.set()
                    await trio.sleep_forever()

        nursery.start_soon(hold)
        await started.wait()
        with pytest.raises(Busy, match="KV cache"):
            await collect(local.generate(big))
        nursery.cancel_scope.cancel()


async def test_cancelling_the_consumer_frees_the_kv_cache(local: LocalGenerator,
                                                          tok: Tokenizer) -> None:
    free = local.stage.kv.free_tokens
    with trio.move_on_after(5):
        async with aclosing(local.generate(request(tok, 500, temperature=0.0))) as events:
            async for _ in events:
                assert local.stage.kv.free_tokens < free
                break
    assert local.stage.kv.free_tokens == free
    assert local._promised == 0


async def test_concurrent_generations_advance_in_turn(local: LocalGenerator,
                                                      tok: Tokenizer) -> None:
    order: list[str] = []

    async def run(name: str) -> None:
        async for event in local.generate(request(tok, 6, temperature=0.0)):
            if isinstance(event, TokenEvent):
                order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a")
        nursery.start_soon(run, "b")
    assert sorted(order) == ["a"] * 6 + ["b"] * 6
    first_b = order.index("b")
    assert "a" in order[first_b:], "b waited for a to finish instead of taking turns"
