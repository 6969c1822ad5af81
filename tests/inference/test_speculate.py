"""Speculative decoding through a route (client.speculate), in process: the tokens are those
of decoding without it, token for token, greedy and seeded, through a failover too; the
guesses come from the context (lookup) or a draft model; k follows what pays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.sampling import SamplingParams
from kvasird.compute.stage import Stage, generate
from kvasird.config import InferenceConfig
from kvasird.inference.api import GenerationRequest, ModelInfo, Sampling, TokenEvent
from kvasird.inference.client import speculate
from kvasird.inference.client.routing import Fitness, Latency
from kvasird.inference.client.speculate import (
    DraftModel,
    Estimates,
    SpeculationError,
    Speculator,
    check_vocabulary,
    lookup,
)
from kvasird.inference.client.swarm import SwarmGenerator
from kvasird.inference.protocol import tensors
from kvasird.inference.protocol.stage import STEP_DIGESTS
from kvasird.inference.server.engine import Served
from kvasird.inference.server.stage import StageServer
from kvasird.model.bundled import bundled_path
from kvasird.text.tokenizer import Tokenizer

from .conftest import N_LAYER, PROMPT
from .fakenet import FakeNet

N = 40


@pytest.fixture(scope="module")
def long_reference(model: Path) -> list[int]:
    """N greedy tokens of PROMPT on one stage holding the whole model."""
    full = Stage.load(model, threads=1, kv=KVSpec(n_slots=256, dtype="f32"))
    try:
        return generate(full, PROMPT, N)
    finally:
        full.close()



def generator(net: FakeNet, **config: Any) -> SwarmGenerator:
    return SwarmGenerator(
        net.me,
        lambda: ModelInfo("m", "test", 256),
        lambda: N_LAYER,
        net.holders,
        net,
        net.servers[net.me].handle,  # type: ignore[arg-type]
        Latency(net.me, lambda p: {"b": 1.0, "b2": 5.0}.get(p, 1.0)),
        Fitness(300),
        InferenceConfig(**config),
        net.inbox,
    )


async def tokens(
    gen: SwarmGenerator, params: SamplingParams, n: int = N, on_token: Any = None
) -> list[int]:
    net: FakeNet = gen.channels  # type: ignore[assignment]
    out: list[int] = []
    async with net.running() as nursery:
        gen.nursery = nursery
        async for event in gen.generate(GenerationRequest("m", tuple(PROMPT), Sampling(params, n))):
            if isinstance(event, TokenEvent):
                out.append(event.token)
                if on_token is not None:
                    on_token(len(out))
    return out


GREEDY = SamplingParams(temperature=0)


async def test_greedy_tokens_with_lookup_guesses_are_those_without(
    net: FakeNet, long_reference: list[int]
) -> None:
    gen = generator(net, speculate="lookup", draft_k=4)
    assert await tokens(gen, GREEDY) == long_reference
    spent = gen.speculation
    assert spent["steps"] > 0 and spent["accepted"] > 0, spent
    assert spent["accepted"] < spent["guessed"]  # some guesses were wrong, and rolled back
    assert all(s.sessions == {} for s in net.servers.values())
    # the hops after the first took each check's rows one at a time, as each was computed
    apart = {peer: s.rows_apart for peer, s in net.servers.items()}
    assert all(apart[h] >= spent["guessed"] for h in ("b", "c")), apart


async def test_guesses_checked_as_one_batch_give_the_same_greedy_tokens_here(
        net: FakeNet, long_reference: list[int]) -> None:
    """speculate_exact false: every hop computes a check's rows as one batch, which rounds
    differently from single steps; on this model no argmax is near a tie, so the tokens
    are the same (on another, a near tie may go the other way)."""
    gen = generator(net, speculate="lookup", draft_k=4, speculate_exact=False)
    assert await tokens(gen, GREEDY) == long_reference
    assert gen.speculation["accepted"] > 0


async def test_seeded_sampling_draws_the_same_tokens_with_and_without_speculation(
    net: FakeNet,
) -> None:
    params = SamplingParams(temperature=0.9, top_k=8, seed=11)
    plain = await tokens(generator(net, speculate="off"), params)
    gen = generator(net, speculate="lookup", draft_k=3)
    assert await tokens(gen, params) == plain
    assert gen.speculation["steps"] > 0


async def test_a_draft_model_drafting_for_itself_is_accepted_and_exact(
    net: FakeNet, model: Path, long_reference: list[int]
) -> None:
    gen = generator(net, speculate="draft", draft_k=4)
    gen.draft = DraftModel(str(model), None, threads=1)
    try:
        assert await tokens(gen, GREEDY) == long_reference
    finally:
        gen.draft.close()
    spent = gen.speculation
    assert spent["accepted"] >= 0.9 * spent["guessed"] > 0, spent
    # every guess right: the draft drafted each next step while the route checked one
    assert spent["ahead"] >= spent["steps"] // 2 > 0, spent


async def test_a_failover_in_the_middle_of_speculation_continues_the_same_tokens(
    net: FakeNet, long_reference: list[int]
) -> None:
    gen = generator(net, speculate="lookup", draft_k=4)

    def kill_b(k: int) -> None:
        if k == 12:
            net.down.add("b")

    assert await tokens(gen, GREEDY, on_token=kill_b) == long_reference
    assert gen.speculation["steps"] > 0


async def test_speculation_off_sends_one_position_a_step(
    net: FakeNet, long_reference: list[int]
) -> None:
    gen = generator(net, speculate="off")
    assert await tokens(gen, GREEDY) == long_reference
    assert gen.speculation["steps"] == 0


def test_lookup_guesses_what_followed_the_latest_occurrence_of_the_tail() -> None:
    history = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3, 8, 8, 1, 2, 3]
    assert lookup(history, 2) == [8, 8]  # the latest earlier "1 2 3" was followed by 8 8
    assert lookup(history, 10) == [8, 8, 1, 2, 3]
    assert lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    assert lookup([5, 6, 5, 6, 5], 4) == [6, 5]  # the tail "5 6 5" at 0 was followed by 6 5


def test_k_is_zero_where_a_row_costs_as_much_as_a_step_and_grows_with_the_circuit() -> None:
    loopback = Estimates(accepted=60, examined=100, t1=0.030, t_row=0.028)
    assert loopback.best_k(16) == 0
    wan = Estimates(accepted=60, examined=100, t1=0.090, t_row=0.010)
    assert wan.best_k(16) >= 2
    assert wan.best_k(1) <= 1  # never past the room left
    sure = Estimates(accepted=990, examined=1000, t1=0.090, t_row=0.010)
    assert sure.best_k(16) > wan.best_k(16)
    assert Estimates().best_k(16) == 0  # nothing measured: a plain step first


def test_estimates_learn_acceptance_and_the_cost_of_a_row() -> None:
    e = Estimates(prior=0.5)
    e.learn(0, 1, 0.1)
    assert e.t1 == pytest.approx(0.1)
    e.learn(4, 5, 0.14)  # all four accepted: a row cost 10 ms
    assert e.t_row == pytest.approx(0.01)
    e.learn(4, 1, 0.14)  # the first guess rejected
    assert e.accepted == pytest.approx(4 * (1 - 0.05)) and e.examined == pytest.approx(
        4 * (1 - 0.05) + 1
    )


def test_a_stale_plain_step_estimate_gives_way_at_once() -> None:
    """A warm-up's slow first step (150 ms) on a ring whose steps take 20 ms: the next
    plain step brings the estimate down, and a step with guesses faster than it does too;
    a slower plain step moves it only halfway."""
    e = Estimates(prior=0.9)
    e.learn(0, 1, 0.150)
    e.learn(4, 5, 0.090)  # faster than a plain step was thought to be: that is stale
    assert e.t1 == pytest.approx(0.090) and e.t_row is None
    e.learn(0, 1, 0.020)
    assert e.t1 == pytest.approx(0.020)
    e.learn(4, 5, 0.100)  # four rows cost 80 ms: 20 ms each, as much as a plain step
    assert e.t_row == pytest.approx(0.020) and e.best_k(16) == 0
    e.learn(0, 1, 0.060)  # a link got slower
    assert e.t1 == pytest.approx(0.040)


def test_a_draft_model_of_another_vocabulary_is_refused_with_what_to_do() -> None:
    served = list(Tokenizer.from_gguf(bundled_path()).tokens)
    check_vocabulary(bundled_path(), served)
    served[100] = "something else"
    with pytest.raises(SpeculationError, match="draft_model"):
        check_vocabulary(bundled_path(), served)
    with pytest.raises(SpeculationError, match="draft_model"):
        check_vocabulary(bundled_path(), [*served, "one more"])


async def test_where_no_guess_pays_a_step_still_guesses_now_and_then_less_and_less_often(
) -> None:
    """Estimates taken in a bad moment (a draft's first prefill, a busy machine) would turn
    speculation off for good: one step in 16, 32, 64, ... still guesses one token, and a new
    generation goes on from the spacing the last one reached (on loopback, where guesses
    never pay, that costs one row in 256 steps)."""
    est = Estimates(accepted=60, examined=100, t1=0.030, t_row=0.028)
    assert est.best_k(16) == 0
    history = [1, 2, 3, 4] * 8

    async def guesses(steps: int) -> list[tuple[int, int]]:
        spec = Speculator("lookup", est, None, 0)
        return [(step, len(g)) for step in range(1, steps + 1)
                if (g := await spec.guess(history, 64))]

    first = await guesses(600)
    assert {n for _, n in first} == {1}
    gaps = [b - a for (a, _), (b, _) in zip(first, first[1:], strict=False)]
    assert first[0][0] >= 16 and gaps == sorted(gaps) and gaps[-1] >= 8 * gaps[0]
    assert est.probe_every == 256
    assert len(await guesses(200)) <= 1  # the next generation does not start over at 16


async def test_a_draft_far_behind_reads_beside_the_steps_and_then_guesses(model: Path) -> None:
    """After steps without guesses the draft model has a stretch of history to read: a
    probe due then does not hold its step up while it reads (it went plain), the draft
    reads it in the nursery, and the probe, still due, guesses once it has read."""
    draft = DraftModel(str(model), None, threads=1)
    est = Estimates(accepted=60, examined=100, t1=0.030, t_row=0.028, probe_every=1)
    spec = Speculator("draft", est, draft, 0)
    history = [*PROMPT, *range(40, 80)]  # 40 tokens past what it read, more than MAX_K + 1
    try:
        async with trio.open_nursery() as nursery:
            spec.prepare(nursery, PROMPT)
            spec.steps = 1  # past the first step, which goes plain (and timed) anyway
            plain = 0
            with trio.fail_after(60):  # the steps go on while the draft reads
                while not (guesses := await spec.guess(history, 64)):
                    plain += 1
                    assert est.probe_every == 1  # the probe stays due
                    await trio.sleep(0.01)
            assert plain >= 1 and len(guesses) == 1
            assert est.probe_every == 2 and spec.session is not None
            assert spec.session.behind(history) == 0
        await spec.aclose()
    finally:
        draft.close()


def test_a_guess_costs_the_last_tokens_share_of_the_history_it_had_not_read(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokens of steps without guesses, read with a guess, are not the guess's cost
    (counted whole, they turned the draft off on a 20 ms ring): a clock that a forward
    moves 1 ms a token."""
    draft = DraftModel(str(model), None, threads=1)
    clock = [0.0]
    forward = draft.stage.forward

    def timed(session: Any, ids: np.ndarray, start: int) -> np.ndarray:
        clock[0] += 0.001 * len(ids)
        return forward(session, ids, start)

    monkeypatch.setattr(draft.stage, "forward", timed)
    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])
    try:
        session = draft.open()
        session.catch_up(PROMPT)
        assert session.guess([*PROMPT, *range(40, 56)], 1)[1] == pytest.approx(0.001)
        assert session.guess([*PROMPT, *range(40, 57)], 3)[1] == pytest.approx(0.003)
    finally:
        draft.close()


def test_a_draft_caught_up_with_the_prompt_guesses_what_one_fed_at_its_first_guess_does(
    model: Path,
) -> None:
    """The gateway feeds the prompt to its draft model while the ring computes it
    (Speculator.prepare): the first guess then feeds one token, and guesses the same."""
    draft = DraftModel(str(model), None, threads=1)
    try:
        fresh, ready = draft.open(), draft.open()
        ready.catch_up(PROMPT)
        history = [*PROMPT, 42]
        guesses = fresh.guess(history, 4)[0]
        assert ready.guess(history, 4)[0] == guesses
        assert ready.held == fresh.held == [*history, *guesses[:3]]
    finally:
        draft.close()


async def test_a_draft_that_cannot_read_the_prompt_fails_no_one(model: Path) -> None:
    """The catch-up runs in the daemon's own nursery: its failure is logged, not raised."""
    draft = DraftModel(str(model), None, threads=1)
    spec = Speculator("draft", Estimates(), draft, 0)
    try:
        assert spec.session is not None

        def broken(history: list[int]) -> None:
            raise RuntimeError("the draft's KV is full")

        spec.session.catch_up = broken  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            spec.prepare(nursery, PROMPT)
        await spec.aclose()
        assert spec.session is None
    finally:
        draft.close()


def part_wire(sid: str, j: int, n: int, row: np.ndarray, ticket: str = "t") -> dict[str, Any]:
    """Row j of n of a forwarded check, as the hop before sends it on alone."""
    return {"op": "step", "sid": sid, "start": len(PROMPT), "x": tensors.encode(row, "f32"),
            "singly": True, "verify": True, "part": [j, n], "owner": "gw",
            "back": {"ticket": ticket}, "next": [["c", "s2"]]}


async def test_a_hop_takes_a_checks_rows_in_order_and_its_close_waits_for_the_last(
        served: dict[str, Served]) -> None:
    """b, a middle hop: the rows of a check come one by one and out of order; b computes
    them in order, sends each on as it is computed, and records the step once, whole; a
    close that comes before the last row waits for it, so b's commitment holds the step.
    The rows it sent are the bits of the same check coming to it whole."""
    sent: list[dict[str, Any]] = []

    async def send(peer: str, msg: dict[str, Any]) -> None:
        sent.append(msg)

    server = StageServer(lambda: "m", lambda: served["b"], max_sessions=4, idle_s=60,
                         wire_dtype="f32", send=send)
    n_embd = served["b"].hp.n_embd
    rng = np.random.default_rng(3)
    prompt, rows = rng.standard_normal((2, len(PROMPT), n_embd), dtype=np.float32)
    for sid in ("s", "whole"):
        await server.handle("gw", {**open_msg(sid), "prev": "a"})
        await server.handle("gw", {"op": "step", "sid": sid, "start": 0,
                                   "x": tensors.encode(prompt, "f32")})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle, "a", part_wire("s", 1, 3, rows[1:2]))
        await trio.sleep(0.01)
        assert sent == []  # row 1 waits for row 0
        await server.handle("a", part_wire("s", 0, 3, rows[0:1]))
    assert [m["part"] for m in sent] == [[0, 3], [1, 3]] and server.rows_apart == 2
    closed: list[dict[str, Any]] = []

    async def close() -> None:
        closed.append(await server.handle("gw", {"op": "close", "sid": "s"}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close)
        await trio.sleep(0.01)
        assert closed == []  # the check's last row is still coming
        await server.handle("a", part_wire("s", 2, 3, rows[2:3]))
    assert len(closed[0]["steps"]) == 2 * STEP_DIGESTS  # the prompt, and the check whole
    apart = np.concatenate([tensors.decode(m["x"], "x", ("f32",), (None, None)) for m in sent])
    sent.clear()
    whole = {**part_wire("whole", 0, 1, rows[:3]), "sid": "whole", "ticket": "w"}
    del whole["part"]
    await server.handle("a", whole)
    assert [m["part"] for m in sent] == [[0, 3], [1, 3], [2, 3]]  # on a row at a time too
    together = np.concatenate(
        [tensors.decode(m["x"], "x", ("f32",), (None, None)) for m in sent])
    assert np.array_equal(apart, together)


def open_msg(sid: str) -> dict[str, Any]:
    """A session on b's layers [1, 3), between two other hops."""
    return {"op": "open", "sid": sid, "model": "m", "first": 1, "end": 3, "embed": False,
            "head": False, "max_tokens": 64, "logprobs": 0, "draws": 0,
            "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                         "repetition_penalty": 1.0, "seed": 1}}


async def test_a_row_that_is_not_its_checks_is_refused_to_its_owner(
        served: dict[str, Served]) -> None:
    """A second row claiming another start than the check's first: the owner hears why, and
    the hop's next step does not wait on the check."""
    sent: list[dict[str, Any]] = []

    async def send(peer: str, msg: dict[str, Any]) -> None:
        sent.append(msg)

    server = StageServer(lambda: "m", lambda: served["b"], max_sessions=4, idle_s=60,
                         wire_dtype="f32", send=send)
    rows = np.random.default_rng(4).standard_normal((2, 1, served["b"].hp.n_embd),
                                                    dtype=np.float32)
    await server.handle("gw", {**open_msg("s"), "prev": "a"})
    await server.handle("a", {**part_wire("s", 0, 2, rows[0]), "start": 0})
    await server.handle("a", {**part_wire("s", 1, 2, rows[1]), "start": 1})
    failures = [m for m in sent if m.get("op") == "result"]
    assert len(failures) == 1 and "its check's" in failures[0]["error"]
    assert server.sessions[("gw", "s")].parts.complete  # type: ignore[union-attr]
