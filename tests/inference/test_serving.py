"""What a node serves, driven through the protocol handlers in process (no network)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from trio.testing import MockClock

from kvasird.compute.experts import ExpertShard
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage, generate
from kvasird.errors import WireError
from kvasird.inference.api import TokenEvent
from kvasird.inference.errors import Refusal, Refused
from kvasird.inference.protocol import tensors
from kvasird.inference.protocol.delegation import Issuer, Verifier
from kvasird.inference.protocol.stage import MAX_TRACE, Failure, Result, parse
from kvasird.inference.server.engine import Holdings, Served
from kvasird.inference.server.experts import ExpertServer
from kvasird.inference.server.stage import StageServer
from kvasird.model.manifest import HEAD, Manifest, Unit
from kvasird.model.slice import ExpertRange as SliceExperts
from kvasird.model.slice import LayerWindow, gguf_pieces, write_slice
from kvasird_dev.testmodels import make_model
from tests.support import Clock, eventually_async

from .conftest import N_EXPERT, N_LAYER, no_remote
from .fakenet import NETWORK, FakeNet, hung, lying

def direct(worker: Served):  # noqa: ANN201 - a RemoteHook
    def hook(layer: int, first: int, end: int) -> ExpertShard:
        w = worker.run_of(layer, 0).worker
        return ExpertShard(first, end, lambda lay, rows, sel: w(lay, rows, sel + first))
    return hook


STAGE = Issuer(create_new_key_pair(), NETWORK)
"""The stage the expert requests of these tests come from (rows of no session: its own)."""


def expert_server(worker: Served, window_s: float = 0) -> ExpertServer:
    return ExpertServer(lambda: worker, window_s=window_s, wire_dtype="f32",
                        delegations=Verifier(NETWORK))


def expert_request(layer: int, first: int, rows: np.ndarray, ids: np.ndarray
                   ) -> dict[str, Any]:
    """What STAGE sends a worker for `rows`, with its own delegation."""
    return {"op": "experts", "layer": layer, "first": first, "rows": tensors.encode(rows, "f32"),
            "ids": tensors.encode(ids, "i32"), "for": [[STAGE.own(), len(rows)]]}


def test_holdings_are_the_ranges_the_engine_loads() -> None:
    units = [HEAD, *(Unit("layer", i) for i in (0, 1, 2, 5, 6)),
             *(Unit("expert", 3, e) for e in (2, 3, 6))]
    assert Holdings.of(units) == Holdings(True, ((0, 3), (5, 7)), ((3, 2, 4), (3, 6, 7)))


async def call(server: StageServer, msg: dict[str, Any]) -> dict[str, Any]:
    return await server.handle("gateway", msg)


def open_msg(sid: str, first: int, end: int, embed: bool, head: bool,
             max_tokens: int = 64) -> dict[str, Any]:
    return {"op": "open", "sid": sid, "model": "m", "first": first, "end": end, "embed": embed,
            "head": head, "max_tokens": max_tokens, "logprobs": 0, "draws": 0,
            "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                         "repetition_penalty": 1.0, "seed": 1}}


def slices(moe: Path, holdings: Holdings, where: Path) -> list[Path]:
    """What a node that downloaded ``holdings`` loads: a slice per window and per range."""
    manifest = Manifest.from_gguf(moe)
    specs = [LayerWindow(a, b, experts=False) for a, b in holdings.windows]
    specs += [SliceExperts(layer, e0, e1) for layer, e0, e1 in holdings.experts]
    with gguf_pieces(moe, manifest) as read:
        return [write_slice(manifest, spec, where / f"{i}.gguf", read)
                for i, spec in enumerate(specs)]


@pytest.mark.parametrize("held, sliced", [
    (((3, 2, 5),), False),
    # several ranges of one layer (the market takes experts one by one), as a node that
    # downloaded them holds them: a slice per range (they once failed to load)
    (((2, 0, 2), (2, 5, 8), (3, 1, 3), (3, 4, 5), (3, 6, 8)), True),
    (((2, 0, 2), (2, 5, 8), (3, 1, 3), (3, 4, 5), (3, 6, 8)), False)])
async def test_a_two_node_ring_with_dispatched_experts_equals_the_whole_model(
        moe: Path, worker: Served, held: tuple[tuple[int, int, int], ...], sliced: bool,
        tmp_path: Path) -> None:
    a = Served.build([moe], Holdings(head=True, windows=((0, 2),)), threads=1, kv_slots=256,
                     remote=direct(worker))
    holdings = Holdings(windows=((2, 4),), experts=held)
    b = Served.build(slices(moe, holdings, tmp_path) if sliced else [moe], holdings, threads=1,
                     kv_slots=256, remote=direct(worker))
    assert [(lay, r.first, r.end) for lay in sorted(b.runs) for r in b.runs[lay]] == list(held)
    full = Stage.load(moe, threads=1, kv=KVSpec(n_slots=256, dtype="f32"))
    try:
        sa = StageServer(lambda: "m", lambda: a, max_sessions=4, idle_s=60, wire_dtype="f32")
        sb = StageServer(lambda: "m", lambda: b, max_sessions=4, idle_s=60, wire_dtype="f32")
        hops = [(sa, open_msg("0", 0, 2, True, False)), (sb, open_msg("1", 2, 4, False, False)),
                (sa, open_msg("2", 4, 4, False, True))]
        for server, msg in hops:
            await call(server, msg)
        history, got = [1, 2, 3], []
        start = 0
        for _ in range(6):
            x: Any = tensors.encode(np.asarray(history[start:]), "i32")
            for (server, msg) in hops:
                step = {"op": "step", "sid": msg["sid"], "start": start, "x": x}
                if msg["head"]:
                    step["ids"] = history[start:]
                reply = await call(server, step)
                x = reply.get("x")
            got.append(reply["token"])
            start = len(history)
            history.append(reply["token"])
        assert got == generate(full, [1, 2, 3], 6)
        for server, msg in hops:
            await call(server, {"op": "close", "sid": msg["sid"]})
        assert sa.sessions == {} and sb.sessions == {}
    finally:
        a.close()
        b.close()
        full.close()


async def test_a_dispatching_stage_awaits_its_experts_on_the_event_loop_for_decode_steps(
        moe: Path, worker: Served) -> None:
    """Decode steps of a stage with remote experts run as steps on the loop (awaiting the
    shard), several sessions' interleaved; a long prefill runs in a worker thread that
    enters the loop per MoE layer."""
    paths: list[str] = []
    sizes: list[tuple[str, int]] = []  # (path, rows) of each expert call
    remote_s = [0.0]
    waiting = [0, 0]  # expert calls awaited now, the most at once

    def hook(layer: int, first: int, end: int) -> ExpertShard:
        w = worker.run_of(layer, 0).worker

        async def acall(lay: int, rows: np.ndarray, sel: np.ndarray) -> np.ndarray:
            paths.append("awaited")
            sizes.append((paths[-1], len(rows)))
            waiting[0] += 1
            waiting[1] = max(waiting[1], waiting[0])
            try:
                await trio.sleep(remote_s[0])  # a remote call yields to the loop
            finally:
                waiting[0] -= 1
            return w(lay, rows, sel + first)

        def call(lay: int, rows: np.ndarray, sel: np.ndarray) -> np.ndarray:
            paths.append("thread")
            sizes.append(("thread", len(rows)))
            return trio.from_thread.run(acall, lay, rows, sel)

        return ExpertShard(first, end, call, acall)

    a = Served.build([moe], Holdings(head=True, windows=((0, N_LAYER),)), threads=1,
                     kv_slots=256, remote=hook)
    full = Stage.load(moe, threads=1, kv=KVSpec(n_slots=256, dtype="f32"))
    try:
        server = StageServer(lambda: "m", lambda: a, max_sessions=4, idle_s=60, wire_dtype="f32")
        await call(server, open_msg("s", 0, N_LAYER, True, True))
        history = [5, 6, 7, 8, 9, 10]
        reply = await call(server, {"op": "step", "sid": "s", "start": 0, "ids": history,
                                    "x": tensors.encode(np.asarray(history), "i32")})
        assert set(paths) == {"thread", "awaited"}  # the prefill: 6 tokens > INLINE_TOKENS
        paths.clear()
        got = [reply["token"]]
        remote_s[0] = 0.005
        for _ in range(3):
            history.append(got[-1])
            reply = await call(server, {"op": "step", "sid": "s", "start": len(history) - 1,
                                        "ids": history[-1:],
                                        "x": tensors.encode(np.asarray(history[-1:]), "i32")})
            got.append(reply["token"])
        assert paths and set(paths) == {"awaited"}
        assert got == generate(full, [5, 6, 7, 8, 9, 10], 4)
        # the step's wait for its remote experts is measured (traced steps report it)
        began, ended, waited = server.sessions[("gateway", "s")].last_step
        assert N_LAYER * 0.005 <= waited < ended - began
        remote_s[0] = 0.0

        # two sessions stepping at once interleave on the loop: one computes while the
        # other waits for its experts, so both have expert calls out at the same time
        paths.clear()
        prompts = {"p": [11, 12, 13], "q": [21, 22, 23]}
        outs: dict[str, list[int]] = {k: [] for k in prompts}
        for sid, prompt in prompts.items():
            await call(server, open_msg(sid, 0, N_LAYER, True, True))
            reply = await call(server, {"op": "step", "sid": sid, "start": 0, "ids": prompt,
                                        "x": tensors.encode(np.asarray(prompt), "i32")})
            outs[sid].append(reply["token"])

        async def decode(sid: str) -> None:
            for _ in range(3):
                ids = [outs[sid][-1]]
                start = len(prompts[sid]) + len(outs[sid]) - 1
                reply = await call(server, {"op": "step", "sid": sid, "start": start,
                                            "ids": ids, "x": tensors.encode(np.asarray(ids),
                                                                            "i32")})
                outs[sid].append(reply["token"])

        paths.clear()
        remote_s[0], waiting[1] = 0.005, 0
        async with trio.open_nursery() as nursery:
            for sid in prompts:
                nursery.start_soon(decode, sid)
        assert set(paths) == {"awaited"} and waiting[1] == 2
        for sid, prompt in prompts.items():
            assert outs[sid] == generate(full, prompt, 4), sid

        # while a prefill holds the stage in a worker thread, another session's decode
        # steps wait for it on the loop, then run there (not queued into threads)
        await call(server, open_msg("long", 0, N_LAYER, True, True))
        long_prompt = list(range(30, 60))
        sizes.clear()
        remote_s[0] = 0.02
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, server, {"op": "step", "sid": "long", "start": 0,
                                              "ids": long_prompt, "x": tensors.encode(
                                                  np.asarray(long_prompt), "i32")})
            await trio.sleep(0.01)  # the prefill has the stage
            nursery.start_soon(decode, "p")
        assert ("thread", len(long_prompt)) in sizes
        assert ("awaited", 1) in sizes and ("thread", 1) not in sizes
        assert outs["p"] == generate(full, prompts["p"], 7)

        # and a prefill arriving while sessions decode without pause gets the stage soon
        # (interleaved steps could otherwise hold it, one always in flight, for ever)
        for sid in ("s", "long", "p", "q"):
            await call(server, {"op": "close", "sid": sid})
        remote_s[0] = 0.005
        positions: dict[str, int] = {}

        async def keep_decoding(sid: str) -> None:
            while positions[sid] < 60:
                at = positions[sid] = positions[sid] + 1
                await call(server, {"op": "step", "sid": sid, "start": at, "ids": [1],
                                    "x": tensors.encode(np.asarray([1]), "i32")})

        for sid in ("d1", "d2"):
            await call(server, open_msg(sid, 0, N_LAYER, True, True))
            await call(server, {"op": "step", "sid": sid, "start": 0, "ids": [1],
                                "x": tensors.encode(np.asarray([1]), "i32")})
            positions[sid] = 0
        await call(server, open_msg("late", 0, N_LAYER, True, True))
        async with trio.open_nursery() as nursery:
            for sid in ("d1", "d2"):
                nursery.start_soon(keep_decoding, sid)
            await trio.sleep(0.1)
            await call(server, {"op": "step", "sid": "late", "start": 0, "ids": long_prompt,
                                "x": tensors.encode(np.asarray(long_prompt), "i32")})
            assert min(positions.values()) < 50  # it had its turn while they decoded
    finally:
        a.close()
        full.close()


def chain_step(sid: str, start: int, ids: list[int], route: list[tuple[str, str]],
               ticket: str) -> dict[str, Any]:
    return {"op": "step", "sid": route[0][1], "start": start, "owner": "gw",
            "x": tensors.encode(np.asarray(ids), "i32"), "ids": ids,
            "next": [list(h) for h in route[1:]], "back": {"ticket": ticket}}


async def test_a_forwarded_chain_passes_boundaries_stage_to_stage(
        moe: Path, worker: Served, nursery: trio.Nursery) -> None:
    a = Served.build([moe], Holdings(head=True, windows=((0, 2),)), threads=1, kv_slots=256,
                     remote=direct(worker))
    b = Served.build([moe], Holdings(windows=((2, 4),)), threads=1, kv_slots=256,
                     remote=direct(worker))
    full = Stage.load(moe, threads=1, kv=KVSpec(n_slots=256, dtype="f32"))
    try:
        net = FakeNet({"gw": a, "b": b}, max_sessions=4)
        net.nursery = nursery
        route = [("gw", "s0"), ("b", "s1"), ("gw", "s2")]
        for i, ((peer, sid), prev) in enumerate(zip(route, ["", "gw", "b"], strict=True)):
            await net.servers[peer].handle("gw", {**open_msg(sid, *[(0, 2, True, False),
                                                                    (2, 4, False, False),
                                                                    (4, 4, False, True)][i]),
                                                  "prev": prev})
        history, got = [1, 2, 3], []
        start = 0
        for n in range(6):
            with net.inbox.expect(f"t{n}", {"gw", "b"}) as results:
                await net.servers["gw"].handle("gw", chain_step("s0", start, history[start:],
                                                                 route, f"t{n}"))
                reply = (await results.receive()).result
            assert isinstance(reply, Result), reply
            got.append(reply.tokens[-1].token)
            start = len(history)
            history.append(reply.tokens[-1].token)
        assert got == generate(full, [1, 2, 3], 6)
        # each step: gw -> b (hidden rows), b -> gw (the head's hop), gw -> gw (the result)
        assert net.sent[:3] == [("gw", "b", "step"), ("b", "gw", "step"), ("gw", "gw", "result")]
        assert net.servers["b"].forwarded == 6

        # a traced step collects each hop's [received, began, ended, handed on, experts
        # waited]; a trace grown past MAX_TRACE hops is dropped and the step goes on
        for n, trace in enumerate(([], [[0.0, 0.0, 0.0, 0.0]] * MAX_TRACE)):
            with net.inbox.expect(f"tr{n}", {"gw", "b"}) as results:
                await net.servers["gw"].handle("gw", {**chain_step("s0", start, history[start:],
                                                                   route, f"tr{n}"),
                                                      "trace": trace})
                reply = (await results.receive()).result
            assert isinstance(reply, Result), reply
            start = len(history)
            history.append(reply.tokens[-1].token)
            if n == 0:
                assert reply.trace is not None
                assert len(reply.trace) == 3 and all(len(hop) == 5 for hop in reply.trace)
                stamps = [t for hop in reply.trace for t in hop[:4]]
                assert stamps == sorted(stamps) and all(isinstance(t, float) for t in stamps)
                assert all(hop[4] == 0.0 for hop in reply.trace)  # its experts are local
            else:
                assert reply.trace is None

        # a peer that is neither the owner nor the hop before cannot step a session
        at = net.servers["b"].sessions[("gw", "s1")].at
        with net.inbox.expect("stray", {"gw", "b"}) as results:
            await net.servers["b"].handle("mallory", {**chain_step("s1", start, [1], route[1:],
                                                                   "stray"),
                                                      "x": tensors.encode(np.zeros((1, 128),
                                                                                   np.float32),
                                                                          "f32")})
            refused = (await results.receive()).result
        assert isinstance(refused, Failure) and refused.code == "bad"
        assert refused.peer == "b" and "only the session's owner" in refused.error
        assert net.servers["b"].sessions[("gw", "s1")].at == at

        # a hop that cannot reach the next one names it in the result
        net.down.add("b")
        with net.inbox.expect("down", {"gw", "b"}) as results:
            await net.servers["gw"].handle("gw", chain_step("s0", start, history[start:],
                                                             route, "down"))
            arrival = await results.receive()
        failed = arrival.result
        assert isinstance(failed, Failure) and arrival.sender == "gw"
        assert failed.peer == "b" and failed.code == "unreachable"
        pong = await net.servers["gw"].handle("gw", {"op": "ping", "sid": "s0"})
        assert pong == {"at": start + 1}
        # results for no one waiting, or from a peer off the route, are dropped
        net.inbox.deliver("b", Result("gone", (TokenEvent(1),)))
        with net.inbox.expect("t", {"gw"}) as results:
            net.inbox.deliver("b", Result("t", (TokenEvent(1),)))
            with pytest.raises(trio.WouldBlock):
                results.receive_nowait()
        assert net.inbox.dropped == 2
    finally:
        a.close()
        b.close()
        full.close()


async def test_admission_refuses_with_a_reason_and_unknown_sessions_are_gone(
        moe: Path, worker: Served) -> None:
    a = Served.build([moe], Holdings(head=True, windows=((0, 4),)), threads=1, kv_slots=128,
                     remote=direct(worker))
    try:
        clock = Clock()
        server = StageServer(lambda: "m", lambda: a, max_sessions=1, idle_s=60, wire_dtype="f32",
                             clock=clock)
        with pytest.raises(Refusal) as exc:
            await call(server, open_msg("big", 0, 4, True, True, max_tokens=1000))
        assert exc.value.code == "busy" and "KV" in exc.value.detail
        await call(server, open_msg("one", 0, 4, True, True))
        with pytest.raises(Refusal) as exc:
            await call(server, open_msg("two", 0, 4, True, True))
        assert exc.value.code == "busy" and "sessions" in exc.value.detail
        with pytest.raises(Refusal) as exc:
            await call(server, {"op": "step", "sid": "nope", "start": 0,
                                "x": tensors.encode(np.array([1]), "i32")})
        assert exc.value.code == "gone"
        with pytest.raises(Refusal) as exc:
            await call(server, open_msg("x", 0, 5, True, False))
        assert exc.value.code == "bad" and "[0, 5)" in exc.value.detail
        clock.now += 60
        server.expire()
        assert list(server.sessions) == [("gateway", "one")]  # idle for idle_s: not yet gone
        clock.now += 1
        server.expire()
        assert server.sessions == {}
        await call(server, open_msg("two", 0, 4, True, True))
        # a node that restarted and is loading is busy for a moment, not at fault
        loading = StageServer(lambda: "m", lambda: None, max_sessions=1, idle_s=60,
                              wire_dtype="f32")
        with pytest.raises(Refusal) as exc:
            await call(loading, open_msg("l", 0, 4, True, True))
        assert exc.value.code == "busy" and "loading" in exc.value.detail
    finally:
        a.close()


async def test_sessions_beyond_the_recurrent_state_slots_are_busy_until_one_closes(
        tmp_path: Path) -> None:
    """A delta-net layer's state is a fixed block per session: a stage admits only as many
    sessions as it has state slots, and a closed session's slot serves the next."""
    hybrid = make_model(tmp_path / "qwen35.gguf", arch="qwen35", n_layer=2, dtype="f32")
    a = Served.build([hybrid], Holdings(head=True, windows=((0, 2),)), threads=1, kv_slots=128,
                     remote=no_remote, state_slots=1)
    try:
        server = StageServer(lambda: "m", lambda: a, max_sessions=4, idle_s=60, wire_dtype="f32")
        await call(server, open_msg("one", 0, 2, True, True))
        await call(server, {"op": "step", "sid": "one", "start": 0, "ids": [1, 2],
                            "x": tensors.encode(np.array([1, 2]), "i32")})
        with pytest.raises(Refusal) as exc:
            await call(server, open_msg("two", 0, 2, True, True))
        assert exc.value.code == "busy" and "recurrent-state" in exc.value.detail
        await call(server, {"op": "close", "sid": "one"})
        await call(server, open_msg("two", 0, 2, True, True))
    finally:
        a.close()


async def test_concurrent_requests_for_one_layer_are_batched_into_one_call(worker: Served) -> None:
    experts = expert_server(worker, window_s=0.05)
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal((n, worker.hp.n_embd)).astype(np.float32) for n in (1, 3, 2)]
    ids = [np.array([[1, 2]]), np.array([[0, 3], [4, 4], [7, 5]]), np.array([[6], [2]])]
    outs: list[Any] = [None] * 3

    async def one(i: int) -> None:
        reply = await experts.handle(STAGE.peer_id, expert_request(1, 0, rows[i], ids[i]))
        outs[i] = tensors.decode(reply["out"], "out", ("f32",), (len(rows[i]), None, None))

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
    assert experts.calls == 1 and experts.rows == 6
    for i in range(3):
        assert np.array_equal(outs[i], worker.run_of(1, 0).worker(1, rows[i], ids[i]))


async def test_expert_ids_count_from_the_range_the_caller_saw(worker: Served) -> None:
    experts = expert_server(worker)
    x = np.ones((1, worker.hp.n_embd), np.float32)
    reply = await experts.handle(STAGE.peer_id, expert_request(0, 4, x, np.array([[1]])))
    want = worker.run_of(0, 0).worker(0, x, np.array([[5]]))
    assert np.array_equal(tensors.decode(reply["out"], "o", ("f32",), (1, 1, None)), want)
    with pytest.raises(Exception, match="outside"):
        await experts.handle(STAGE.peer_id, expert_request(0, 4, x, np.array([[4]])))


async def test_a_worker_whose_outputs_are_off_is_caught_by_a_spot_check(
        worker: Served) -> None:
    """A spot check recomputes on our own copy of the experts: a lying worker is marked
    unfit and the true outputs are used instead of its own."""
    from kvasird.inference.client.dispatch import ExpertDispatcher
    from kvasird.inference.client.routing import Fitness, Latency

    net, fitness = FakeNet({}, me=STAGE.peer_id, experts={"w": worker}), Fitness(60)
    dispatcher = ExpertDispatcher(
        STAGE, net.holders, net, Latency(STAGE.peer_id, lambda p: 1.0),  # type: ignore[arg-type]
        fitness, lambda layer, expert: (worker.run_of(layer, 0).worker, 0, N_EXPERT), timeout_s=5,
        wire_dtype="f32", spot_check=1.0, tolerance=0.01)
    rows = np.ones((1, worker.hp.n_embd), np.float32)
    ids = np.array([[1, 6]])
    honest = worker.run_of(2, 0).worker(2, rows, ids)
    assert np.array_equal(await dispatcher.checked("w", 0, 2, rows, ids), honest)
    assert dispatcher.stats["caught"] == 0 and fitness.fit("w")
    net.faults["w"] = lying
    assert np.array_equal(await dispatcher.checked("w", 0, 2, rows, ids), honest)
    assert dispatcher.stats["caught"] == 1 and not fitness.fit("w")


def lone_worker(worker: Served) -> tuple[FakeNet, Any, Any]:
    """A stage's dispatcher whose every expert is on one worker "w" (no copy of its own)."""
    from kvasird.inference.client.dispatch import ExpertDispatcher
    from kvasird.inference.client.routing import Fitness, Latency

    net, fitness = FakeNet({}, me=STAGE.peer_id, experts={"w": worker}), Fitness(300)
    dispatcher = ExpertDispatcher(
        STAGE, net.holders, net, Latency(STAGE.peer_id, lambda p: 1.0),  # type: ignore[arg-type]
        fitness, lambda layer, expert: None, timeout_s=5, wire_dtype="f32", spot_check=0.0,
        tolerance=0.01)
    return net, fitness, dispatcher


async def test_an_expert_worker_that_answers_again_is_forgiven_its_strikes(
        worker: Served, autojump_clock: MockClock) -> None:
    """A worker that failed is avoided for a short sentence; once it computes again its
    strikes are cleared, so its next failure costs the short sentence again, not double."""
    from kvasird.inference.client.dispatch import NoWorkers

    net, fitness, dispatcher = lone_worker(worker)
    rows = np.ones((1, worker.hp.n_embd), np.float32)
    ids = np.array([[1, 6]])
    net.faults["w"] = hung(lambda msg: True)
    with pytest.raises(NoWorkers):  # once, then once more as the last resort
        await dispatcher.compute(0, 0, N_EXPERT, rows, ids)
    assert fitness.strikes == {"w": 2} and not fitness.fit("w")
    del net.faults["w"]
    await eventually_async("w serves its sentence (at most Fitness's 300 s)",
                           lambda: fitness.fit("w"), timeout=301, every=1)
    out = await dispatcher.compute(0, 0, N_EXPERT, rows, ids)
    assert np.array_equal(out, worker.run_of(0, 0).worker(0, rows, ids))
    assert fitness.strikes == {}


async def test_the_only_worker_of_a_range_failing_once_is_asked_again(
        worker: Served, autojump_clock: MockClock) -> None:
    """When no fit worker holds a range, one that failed once is the last resort (a worker
    whose first call timed out on a busy machine, or that refused while it reloaded): the
    step computes instead of failing the request; a liar is never asked again."""
    from kvasird.inference.client.dispatch import NoWorkers

    net, fitness, dispatcher = lone_worker(worker)
    rows = np.ones((1, worker.hp.n_embd), np.float32)
    ids = np.array([[1, 6]])
    calls = [0]

    def first_call(msg: dict[str, Any]) -> bool:
        calls[0] += 1
        return calls[0] == 1

    net.faults["w"] = hung(first_call)
    out = await dispatcher.compute(0, 0, N_EXPERT, rows, ids)
    assert np.array_equal(out, worker.run_of(0, 0).worker(0, rows, ids))
    assert calls[0] == 2 and dispatcher.stats["failovers"] == 1
    assert fitness.strikes == {} and fitness.fit("w")  # it answered: pardoned
    fitness.mark("w", "lied")
    with pytest.raises(NoWorkers, match="no fit worker holds experts"):
        await dispatcher.compute(0, 0, N_EXPERT, rows, ids)
    assert calls[0] == 2


def test_only_short_forwarded_steps_on_a_node_without_remote_experts_run_inline(
        moe: Path, worker: Served, held_elsewhere: Callable[[Any], Any]) -> None:
    own = Served.build([moe], Holdings(head=True, windows=((0, N_LAYER),),
                                       experts=tuple((lay, 0, N_EXPERT) for lay in range(N_LAYER))),
                       threads=1, kv_slots=256, remote=no_remote)
    remote = Served.build([moe], Holdings(windows=((0, 2),)), threads=1, kv_slots=256,
                          remote=direct(worker))
    try:
        def step(rows: int, **extra: Any) -> Any:  # as channel.serve hands it over: parsed
            return parse({"op": "step", "sid": "s", "start": 0, "id": 0, **extra,
                          "x": tensors.encode(np.zeros((rows, 64), np.float32), "f32")})

        forwarded = {"back": {"ticket": "t"}, "next": []}
        plain = StageServer(lambda: "m", lambda: own, max_sessions=4, idle_s=60,
                            wire_dtype="f32")
        assert plain.inline(step(1, **forwarded))
        assert plain.inline(Result("t", (TokenEvent(3),)))
        assert not plain.inline(step(64, **forwarded))  # a prefill goes to a thread
        assert not plain.inline(step(1))  # a request (the gateway waits for its answer)
        assert not plain.inline(parse(open_msg("s", 0, N_LAYER, True, True)))
        with pytest.raises(WireError, match="stage.x"):  # a malformed step never gets here
            parse({"op": "step", "sid": "s", "start": 0, "id": 0, **forwarded,
                   "x": {"shape": "bad"}})
        with held_elsewhere(own.backend.lock):  # a long computation in a thread
            assert not plain.inline(step(1, **forwarded))  # the reader must not wait for it
        assert plain.inline(step(1, **forwarded))
        dispatching = StageServer(lambda: "m", lambda: remote, max_sessions=4, idle_s=60,
                                  wire_dtype="f32")
        assert not dispatching.inline(step(1, **forwarded))  # it awaits remote experts
        nothing = StageServer(lambda: "m", lambda: None, max_sessions=4, idle_s=60,
                              wire_dtype="f32")
        assert not nothing.inline(step(1, **forwarded))
    finally:
        own.close()
        remote.close()


async def test_concurrent_sessions_rows_for_one_worker_go_as_one_message(
        worker: Served, tmp_path: Path) -> None:
    """The dispatcher coalesces only while several decode steps are interleaved here; what
    it sends on a real channel is answered by a real worker, each part as if sent alone."""
    from kvasird.identity import load_node_key
    from kvasird.inference.client.dispatch import ExpertDispatcher
    from kvasird.inference.client.hotcache import HotExperts
    from kvasird.inference.client.routing import Fitness, Latency, PeerHoldings
    from kvasird.inference.protocol import EXPERT_PROTOCOL
    from kvasird.inference.stepcontext import COMPANY, Company
    from kvasird.inference.transport.channel import Channels, serve

    from .test_channel import pair

    rng = np.random.default_rng(2)
    rows = [rng.standard_normal((1, worker.hp.n_embd)).astype(np.float32) for _ in range(3)]
    gids = [np.array([[1, 6]]), np.array([[0, 3]]), np.array([[7, 2]])]
    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        server = expert_server(worker)
        b.set_stream_handler(EXPERT_PROTOCOL, lambda s: serve(s, server.handle, 10))
        channels = Channels(a, lanes=False)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        holders = [PeerHoldings(peer, False, (), tuple((lay, 0, N_EXPERT)
                                                       for lay in range(N_LAYER)))]
        dispatcher = ExpertDispatcher(
            Issuer(load_node_key(tmp_path / "0.key").keypair, NETWORK), lambda: holders,
            channels, Latency("me", lambda p: 1.0),
            Fitness(60), lambda layer, expert: None, timeout_s=5, wire_dtype="f32", spot_check=0,
            tolerance=0.01, hot=HotExperts(None, 0, 0), window_s=0.5)
        outs: list[Any] = [None] * 3

        async def step(i: int, company: Company | None) -> None:
            COMPANY.set(company)  # this task's context: as if its decode step were running
            outs[i] = await dispatcher.remote(peer, 0, 1, rows[i], gids[i])

        for company in (None, Company()):  # alone; then three sessions stepping at once
            if company is not None:
                company.now = 3
            calls = dispatcher.stats["calls"]
            async with trio.open_nursery() as inner:
                for i in range(3):
                    inner.start_soon(step, i, company)
            assert dispatcher.stats["calls"] - calls == (3 if company is None else 1)
            for i in range(3):
                assert np.array_equal(outs[i], worker.run_of(1, 0).worker(1, rows[i], gids[i]))
        assert dispatcher.stats["coalesced"] == 2
        # the worker refusing the message fails every session that was in it
        refused: list[Exception] = []

        async def refused_step(i: int, company: Company) -> None:
            COMPANY.set(company)
            try:
                await dispatcher.remote(peer, 0, N_LAYER + 5, rows[i], gids[i])
            except Refused as exc:
                refused.append(exc)

        three = Company()
        three.now = 3
        async with trio.open_nursery() as inner:
            for i in range(3):
                inner.start_soon(refused_step, i, three)
        assert len(refused) == 3 and len({id(e) for e in refused}) == 1
        # a session whose company never reaches the layer waits only the window
        lonely = Company()
        lonely.now = 4
        began = trio.current_time()
        await step(0, lonely)
        assert 0.5 <= trio.current_time() - began < 2.5
        nursery.cancel_scope.cancel()
