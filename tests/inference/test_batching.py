"""Decode batching at a stage (server.batch): concurrent sessions' decode steps through the
same stages compute as one graph, each session's output what it computes alone; a batch
that fails as a whole answers each step for itself; a session cancelled in the queue
holds no one up. Driven through the stage protocol's handler in process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import trio
from trio.testing import wait_all_tasks_blocked as wait_all_blocked

from kvasird.compute.errors import InputError, RunRefused
from kvasird.compute.kv.keys import PAGE
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import KV_BUCKET, Stage, generate
from kvasird.inference.errors import Refusal
from kvasird.inference.protocol import tensors
from kvasird.inference.server import batch
from kvasird.inference.server.batch import Batcher, _Queue
from kvasird.inference.server.engine import Holdings, Served
from kvasird.inference.server.stage import StageServer
from kvasird_dev.testmodels import make_model

from tests.support import Clock

from .conftest import no_remote
from .test_serving import call, open_msg

N_LAYER = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("batch") / "llama.gguf", arch="llama",
                      n_layer=N_LAYER, seed=4, dtype="q8_0")


@pytest.fixture(scope="module")
def node(llama: Path) -> Iterator[Served]:
    served = Served.build([llama], Holdings(head=True, windows=((0, N_LAYER),)), threads=1,
                          kv_slots=64 * PAGE, remote=no_remote)
    yield served
    served.close()


@pytest.fixture(scope="module")
def full(llama: Path) -> Iterator[Stage]:
    stage = Stage.load(llama, threads=1, kv=KVSpec(n_slots=64 * PAGE))
    yield stage
    stage.close()


def prompt(i: int) -> list[int]:
    # lengths on both sides of a KV bucket: sessions of one batch gather different pages
    n = [3, 40, KV_BUCKET - 1, KV_BUCKET + 5, 1, 17][i % 6]
    return np.random.default_rng(i).integers(1, 1000, n).tolist()


def step_msg(sid: str, start: int, ids: list[int]) -> dict[str, Any]:
    return {"op": "step", "sid": sid, "start": start, "ids": ids,
            "x": tensors.encode(np.asarray(ids), "i32")}


async def generation(server: StageServer, sid: str, ids: list[int], n: int) -> list[int]:
    await call(server, open_msg(sid, 0, N_LAYER, True, True, max_tokens=KV_BUCKET + 64))
    history, got = list(ids), []
    reply = await call(server, step_msg(sid, 0, history))
    for _ in range(n - 1):
        got.append(reply["token"])
        history.append(got[-1])
        reply = await call(server, step_msg(sid, len(history) - 1, history[-1:]))
    got.append(reply["token"])
    await call(server, {"op": "close", "sid": sid})
    return got


async def generations(server: StageServer, n: int, tokens: int) -> dict[int, list[int]]:
    """n generations of `tokens` tokens at once, session i from prompt(i)."""
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        got[i] = await generation(server, f"s{i}", prompt(i), tokens)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return got


def test_a_batch_computes_what_each_session_computes_alone(full: Stage) -> None:
    """Stage.forward_batch: sessions at different positions (across KV buckets) give
    bitwise their solo logits, and the KV each one wrote is its own."""
    solo, batched = [], []
    for out in (solo, batched):
        sessions = [full.open_session() for _ in range(6)]
        for i, s in enumerate(sessions):
            full.forward(s, np.asarray(prompt(i)), 0)
        for step in range(3):
            runs = [(s, np.array([7 + i + step]), s.n_past) for i, s in enumerate(sessions)]
            rows = full.forward_batch(runs) if out is batched else \
                [full.forward(s, x, at) for s, x, at in runs]
            out.append(np.concatenate(rows))
        for s in sessions:
            s.close()
    assert np.array_equal(np.stack(solo), np.stack(batched))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prompts_and_decode_steps_of_any_lengths_batch_as_each_computes_alone(
        arch: str, llama: Path, tmp_path: Path) -> None:
    """Stage.forward_batch with runs of different lengths (new prompts, a continued one,
    decode steps; at the head and as a middle hop): per run what `forward` gives it, and
    the KV each wrote its own (the next steps agree too). gemma3: each in its own ring."""
    path = llama if arch == "llama" else make_model(
        tmp_path / "gemma3.gguf", arch="gemma3", n_layer=N_LAYER, sliding_window=100, seed=6,
        dtype="q8_0")
    rng = np.random.default_rng(1)
    for head in (True, False):
        stage = Stage.load(path, threads=1, kv=KVSpec(n_slots=64 * PAGE), head=head,
                           embed=head)

        def rows(n: int) -> np.ndarray:
            return rng.integers(1, 1000, n) if head else \
                rng.standard_normal((n, stage.hp.n_embd)).astype(np.float32)

        before = [rows(40), rows(120)]  # two sessions are far into their contexts
        runs = [(0, rows(5), 0), (1, rows(1), 40), (2, rows(9), 0), (3, rows(7), 120),
                (4, rows(5), 0)]
        then = [rows(1) for _ in runs]
        results = []
        for batched in (False, True):
            sessions = [stage.open_session() for _ in runs]
            for s, x in zip((sessions[1], sessions[3]), before, strict=True):
                stage.forward(s, x, 0)
            steps = [(sessions[i], x, at) for i, x, at in runs]
            outs = stage.forward_batch(steps) if batched else \
                [stage.forward(s, x, at) for s, x, at in steps]
            outs += [stage.forward(s, x, s.n_past) for s, x in zip(sessions, then, strict=True)]
            results.append(outs)
            for s in sessions:
                s.close()
        for solo, batched in zip(*results, strict=True):
            assert solo.shape == batched.shape
            np.testing.assert_allclose(batched, solo, rtol=1e-3, atol=1e-3 * np.abs(solo).max())
        stage.close()


def test_a_batch_refuses_what_it_cannot_compute(full: Stage) -> None:
    with full.open_session() as a, full.open_session() as b:
        full.forward(a, np.array([1, 2]), 0)
        with pytest.raises(InputError, match="once"):
            full.forward_batch([(a, np.array([3]), 2), (a, np.array([4]), 3)])
        with pytest.raises(RunRefused, match="at most 64") as refused:
            full.forward_batch([(a, np.ones(PAGE + 1, int), 2), (b, np.array([4]), 0)])
        assert refused.value.index == 0 and isinstance(refused.value.error, InputError)
        with pytest.raises(RunRefused, match="past the cached context") as refused:
            full.forward_batch([(a, np.array([3]), 2), (b, np.array([4]), 5)])
        assert refused.value.index == 1
        assert a.n_past == 2  # nothing computed: the good run did not advance


async def test_concurrent_sessions_decode_in_batches_with_their_solo_tokens(
        node: Served, full: Stage) -> None:
    server = StageServer(lambda: "m", lambda: node, max_sessions=8, idle_s=60,
                         wire_dtype="f32", batch_window_s=0.05)
    got = await generations(server, 6, 8)
    for i in range(6):
        assert got[i] == generate(full, prompt(i), 8), f"session {i}"
    stats = server.batcher.stats
    assert stats["batches"] > 0 and stats["largest"] >= 2, stats
    assert stats["split"] == 0


async def test_new_sessions_prompts_batch_with_each_other_and_with_decode_steps(
        node: Served, full: Stage) -> None:
    """Eight sessions opened at once: the first prompt runs alone, the ones arriving
    meanwhile compute together (and with the first one's decode steps), each session still
    generating its solo tokens. A prompt crossing a prefill piece's end runs alone."""
    server = StageServer(lambda: "m", lambda: node, max_sessions=8, idle_s=60,
                         wire_dtype="f32", batch_window_s=0.05)
    prompts = {i: np.random.default_rng(50 + i).integers(1, 1000, [5, 9, 3, 40][i % 4]).tolist()
               for i in range(8)}
    prompts[7] = np.random.default_rng(7).integers(1, 1000, PAGE + 3).tolist()
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        got[i] = await generation(server, f"p{i}", prompts[i], 6)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, i)
    for i in range(8):
        assert got[i] == generate(full, prompts[i], 6), f"session {i}"
    stats = server.batcher.stats
    assert 2 <= stats["prompts"] <= 6, stats  # not the first, nor the one of 67 tokens
    assert stats["split"] == stats["refused"] == 0


async def test_sessions_of_a_sliding_window_model_decode_in_batches(tmp_path: Path) -> None:
    """gemma3 (a 100-position window over 64-slot pages, each session its own ring in the
    window pool): six concurrent generations batch, each with its solo tokens."""
    path = make_model(tmp_path / "gemma3.gguf", arch="gemma3", n_layer=N_LAYER,
                      sliding_window=100, seed=6, dtype="q8_0")
    served = Served.build([path], Holdings(head=True, windows=((0, N_LAYER),)), threads=1,
                          kv_slots=64 * PAGE, remote=no_remote, window_sessions=6)
    alone = Stage.load(path, threads=1, kv=KVSpec(n_slots=64 * PAGE))
    try:
        assert served.windows[0, N_LAYER].kv.window_layers
        server = StageServer(lambda: "m", lambda: served, max_sessions=8, idle_s=60,
                             wire_dtype="f32", batch_window_s=0.05)
        got = await generations(server, 6, 8)
        for i in range(6):
            assert got[i] == generate(alone, prompt(i), 8), f"session {i}"
        stats = server.batcher.stats
        assert stats["batches"] > 0 and stats["largest"] >= 2 and stats["split"] == 0, stats
    finally:
        alone.close()
        served.close()


async def test_a_lone_session_never_batches(node: Served, full: Stage) -> None:
    server = StageServer(lambda: "m", lambda: node, max_sessions=8, idle_s=60,
                         wire_dtype="f32")
    assert await generation(server, "alone", prompt(1), 6) == generate(full, prompt(1), 6)
    assert server.batcher.stats["batches"] == 0
    # and no step went to a worker thread as a batch of one: each ran alone, as before
    assert all(q.compute_s == 0 and q.fastest < float("inf")
               for q in server.batcher._queues.values())


async def test_a_bad_step_is_refused_alone_and_its_batch_goes_on(
        node: Served, full: Stage) -> None:
    """One session sends a position past its context: that step alone is refused (it runs
    alone and gets its own answer) and the others still compute as one batch, so one
    session cannot make every session it shares a batch with compute alone. The sessions
    count as stepping until a while after their last step, on the server's clock."""
    clock = Clock()
    server = StageServer(lambda: "m", lambda: node, max_sessions=8, idle_s=60,
                         wire_dtype="f32", batch_window_s=0.05, clock=clock)
    for i in range(3):
        await call(server, open_msg(f"s{i}", 0, N_LAYER, True, True))
        await call(server, step_msg(f"s{i}", 0, prompt(i)[:3]))
    server.batcher._queues.clear()
    replies: dict[int, Any] = {}

    async def one(i: int, start: int) -> None:
        try:
            replies[i] = await call(server, step_msg(f"s{i}", start, [9]))
        except Refusal as exc:
            replies[i] = exc

    for _ in range(2):  # the second round: each session counts as stepping, so they batch
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i, 3 if i != 1 else 7)
    assert isinstance(replies[1], Refusal) and replies[1].code == "bad"
    assert "past the cached context" in replies[1].detail
    for i in (0, 2):
        with full.open_session() as s:
            logits = full.forward(s, np.asarray(prompt(i)[:3] + [9]), 0)
        assert replies[i]["token"] == int(np.argmax(logits[-1]))
    stats = server.batcher.stats
    assert stats["refused"] >= 1 and stats["split"] == 0 and stats["largest"] == 2, stats
    assert server.batcher.company()
    clock.now += 60  # they stopped stepping
    assert not server.batcher.company()


async def test_a_session_cancelled_in_the_queue_holds_no_one_up(
        node: Served, full: Stage) -> None:
    """One of four batching sessions is cancelled after a few scheduler passes (queued,
    gathering as the leader, or in a batch computing): the other three get their tokens
    and the queue is left idle."""
    server = StageServer(lambda: "m", lambda: node, max_sessions=8, idle_s=60,
                         wire_dtype="f32", batch_window_s=0.05)
    tokens: dict[str, int] = {}
    scopes: dict[str, trio.CancelScope] = {}

    async def one(sid: str, start: int) -> None:
        with trio.CancelScope() as scopes[sid]:
            tokens[sid] = (await call(server, step_msg(sid, start, [9])))["token"]

    for passes in range(8):
        sids = [f"s{passes}.{i}" for i in range(4)]
        for sid in sids:
            await call(server, open_msg(sid, 0, N_LAYER, True, True))
            await call(server, step_msg(sid, 0, [1, 2, 3]))
        async with trio.open_nursery() as nursery:  # every session stepping: they batch
            for sid in sids:
                nursery.start_soon(one, sid, 3)
        tokens.clear()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for sid in sids:
                    nursery.start_soon(one, sid, 4)
                for _ in range(passes):
                    await trio.lowlevel.checkpoint()
                scopes[sids[2]].cancel()
        assert {sids[0], sids[1], sids[3]} <= set(tokens)
        assert not any(q.waiting or q.busy for q in server.batcher._queues.values())
        for sid in sids:
            await call(server, {"op": "close", "sid": sid})
    assert server.batcher.stats["batches"] >= 1


class Gate:
    """A stage whose batches pass their rows through once `open` is set (in the thread)."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def forward_batch(self, runs: list[tuple[Any, np.ndarray, int]]) -> list[np.ndarray]:
        assert self.open.wait(30)
        return [x for _, x, _ in runs]


@dataclass(eq=False)
class Hop:
    """What the batcher reads of a served session: its chain and its KV sessions."""

    chain: list[Any]
    sessions: list[Any] = field(default_factory=lambda: [None])


async def test_a_step_cancelled_behind_a_computing_batch_holds_no_one_up() -> None:
    """A step queued behind a batch is cancelled as the batch ends (and may be handed the
    lead of the next one): the step behind it still runs, and the queue ends idle."""
    for _ in range(10):
        await lead_cancelled_once()


async def lead_cancelled_once() -> None:
    batcher, gate = Batcher(16, window_s=0.0), Gate()
    chain = [gate]
    warm, lead, first, second = (Hop(chain) for _ in range(4))
    done: list[Hop] = []

    async def solo(s: Any, x: np.ndarray, start: int) -> np.ndarray:
        return x

    async def step(s: Hop, scope: trio.CancelScope) -> None:
        with scope:
            await batcher.step(s, np.zeros(1), 0, solo)  # type: ignore[arg-type]
            done.append(s)

    await step(warm, trio.CancelScope())  # alone, fast: from now on the chain batches
    scopes = [trio.CancelScope() for _ in range(3)]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(step, lead, scopes[0])
            await wait_all_blocked()  # lead computes its batch in a thread, at the gate
            for s, scope in ((first, scopes[1]), (second, scopes[2])):
                nursery.start_soon(step, s, scope)
                await wait_all_blocked()
            scopes[1].cancel()
            gate.open.set()
    assert lead in done and second in done and first not in done
    assert not any(q.waiting or q.busy for q in batcher._queues.values())


async def test_prompts_queued_behind_a_long_first_one_batch_however_long_they_waited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """New sessions' prompts queue behind the first one, which runs alone (whether batching
    pays is not known yet) and takes a second (an injected clock): then they compute as one
    batch, not each alone for having waited longer than sessions count as stepping."""
    clock = [0.0]
    monkeypatch.setattr(batch, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    batcher, gate, done = Batcher(16, window_s=0.0), Gate(), trio.Event()
    gate.open.set()

    async def solo(s: Any, x: np.ndarray, start: int) -> np.ndarray:
        await done.wait()
        clock[0] += 1.0
        return x

    async def prompt_of(s: Hop, rows: int) -> None:
        await batcher.step(s, np.zeros(rows), 0, solo)  # type: ignore[arg-type]

    chain = [gate]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(prompt_of, Hop(chain), 5 + i)
                await wait_all_blocked()
            done.set()
    assert batcher.stats == {"batches": 1, "rows": 5, "largest": 5, "prompts": 5,
                             "refused": 0, "split": 0}


async def test_steps_shorter_than_the_batching_minimum_are_not_held_for_company(
        node: Served, full: Stage) -> None:
    """A chain whose steps compute for less than batch_min_s alone never waits for other
    sessions (a ring of short hops pipelines better than it gathers): a step that finds
    the chain idle runs as it did alone, in place; only the steps that queued while
    another computed go together (nobody waited for them)."""
    server = StageServer(lambda: "m", lambda: node, max_sessions=8, idle_s=60,
                         wire_dtype="f32", batch_window_s=0.05, batch_min_s=10.0)
    got = await generations(server, 4, 4)
    assert all(got[i] == generate(full, prompt(i), 4) for i in range(4))
    queue = next(iter(server.batcher._queues.values()))
    assert not queue.pays(server.batcher.min_step_s) and queue.compute_s < 0.05
    assert server.batcher.stats["batches"] > 0  # the steps that queued behind a step


def test_a_deep_ring_batches_a_share_of_its_sessions_unless_told_to_batch_all() -> None:
    """A hop whose sessions are away (at the ring's other hops) for D-1 times what a batch
    computes here takes a D-th of the sessions stepping in a batch, so that D batches keep
    every hop busy; batch_pipelined false takes them all (up to batch_sessions)."""
    q = _Queue(compute_s=0.002)
    assert q.cap(16, 6) == 6  # nobody is away yet: one node, or a ring not yet measured
    q.away_s = 0.004  # a 3-hop ring: 3 batches in flight
    assert q.cap(16, 6) == 2 and q.cap(16, 7) == 3 and q.cap(2, 16) == 2
    q.away_s = 0.02  # away for ten computes: each step alone
    assert q.cap(16, 6) == 1
    assert Batcher(16, 0.0).pipelined and not Batcher(16, 0.0, pipelined=False).pipelined
