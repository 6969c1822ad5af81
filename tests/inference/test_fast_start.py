"""A route whose links are long opens its sessions with the first prompt chunk (Step.open),
in process: no round trip to open, the tokens those of the whole model, a hop that is
slow to be reached not taken for a dead one, opens in a gateway's name refused without its
word, and the first chunk spot-checked after the generation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from kvasird.compute.sampling import SamplingParams
from kvasird.config import InferenceConfig
from kvasird.inference.api import GenerationRequest, ModelInfo, Sampling, TokenEvent
from kvasird.inference.client.routing import Fitness, Latency
from kvasird.inference.client.spotcheck import SpotChecks
from kvasird.inference.client.swarm import FAST_START_RTT_MS, SwarmGenerator
from kvasird.inference.errors import HopFailed, Refusal
from kvasird.inference.protocol.delegation import Issuer
from kvasird.inference.protocol.stage import Forward, Open, Step
from kvasird.inference.server.engine import Holdings, Served
from kvasird.inference.server.stage import StageServer
from kvasird.inference.transport.channel import Channels

from .conftest import N_LAYER, PROMPT
from .fakenet import NETWORK, FakeNet, no_experts

GW = Issuer(create_new_key_pair(), NETWORK)


@pytest.fixture
def net(served: dict[str, Served]) -> Iterator[FakeNet]:
    """The gateway GW (embed, layer 0, head) → b (layers 1-2) → c (layer 3)."""
    net = FakeNet({GW.peer_id: served["gw"], "b": served["b"], "c": served["c"]}, me=GW.peer_id)
    yield net
    for server in net.servers.values():
        server.close_all()


def generator(net: FakeNet, rtt_ms: float, **spot: Any) -> SwarmGenerator:
    return SwarmGenerator(
        net.me, lambda: ModelInfo("m", "test", 256), lambda: N_LAYER, net.holders,
        net, net.servers[net.me].handle,  # type: ignore[arg-type]
        Latency(net.me, lambda p: rtt_ms * (2 if p in ("b2", "b3") else 1)), Fitness(300),
        InferenceConfig(speculate="off"),
        net.inbox, issuer=GW, spot=SpotChecks(**spot) if spot else None)


def opens_seen(net: FakeNet) -> list[tuple[str, str]]:
    """Record (peer, how) for every session b and c open: "request" or "with a step"."""
    seen: list[tuple[str, str]] = []

    def watch(peer: str) -> Any:
        def fault(handle: Any) -> Any:
            async def watching(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
                if msg.get("op") == "open":
                    seen.append((peer, "request"))
                elif msg.get("op") == "step" and "open" in msg:
                    seen.append((peer, "with a step"))
                return await handle(caller, msg)
            return watching
        return fault

    net.faults["b"], net.faults["c"] = watch("b"), watch("c")
    return seen


async def tokens(gen: SwarmGenerator, n: int = 10) -> list[int]:
    net: FakeNet = gen.channels  # type: ignore[assignment]
    out: list[int] = []
    async with net.running() as nursery:
        gen.nursery = nursery
        request = GenerationRequest("m", tuple(PROMPT), Sampling(SamplingParams(temperature=0), n))
        async for event in gen.generate(request):
            if isinstance(event, TokenEvent):
                out.append(event.token)
    return out


async def test_a_far_route_opens_its_sessions_with_the_first_chunk(
        net: FakeNet, reference: list[int]) -> None:
    seen = opens_seen(net)
    gen = generator(net, 2 * FAST_START_RTT_MS)
    assert await tokens(gen) == reference
    assert sorted(seen) == [("b", "with a step"), ("c", "with a step")]
    assert all(s.sessions == {} for s in net.servers.values())
    # the chunk that opened the route was traced at every hop, apart from decode steps
    first = gen.first_traces.summary()
    assert first["steps"] == 1 and len(first["last"]["hops_ms"]) == len(first["route"]) > 1


async def test_a_near_route_opens_first_and_relays_its_first_chunk(
        net: FakeNet, reference: list[int]) -> None:
    seen = opens_seen(net)
    assert await tokens(generator(net, 1.0)) == reference
    assert sorted(seen) == [("b", "request"), ("c", "request")]


@pytest.fixture(scope="module")
def whole(model: Path) -> Iterator[Served]:
    """A peer serving the whole model: one hop is a gateway's whole route."""
    out = Served.build([model], Holdings(head=True, windows=((0, N_LAYER),)), threads=1,
                       kv_slots=256, remote=no_experts)
    yield out
    out.close()


async def test_a_far_route_of_one_hop_opens_its_session_with_the_first_chunk(
        served: dict[str, Served], whole: Served, reference: list[int]) -> None:
    """A gateway holding nothing routes through one peer: the chunk carries the open (a
    relayed step would reach a session that does not exist yet), every request in a row."""
    net = FakeNet({GW.peer_id: served["gw"], "b": whole}, me=GW.peer_id)
    net.unlisted.add(GW.peer_id)  # the gateway holds nothing of the model
    seen = opens_seen(net)
    try:
        gen = generator(net, 2 * FAST_START_RTT_MS)
        for _ in range(3):
            assert await tokens(gen) == reference
        assert seen == [("b", "with a step")] * 3
        assert gen.fitness.snapshot() == {}
    finally:
        for server in net.servers.values():
            server.close_all()


async def test_a_hop_the_first_chunk_has_not_reached_yet_is_not_taken_for_a_dead_one(
        net: FakeNet, reference: list[int]) -> None:
    """c's session does not exist until b has computed the chunk: a probe meanwhile finds
    it "gone", which on a route opening with its step means "not reached yet"."""
    slow = trio.Event()

    def slow_b(handle: Any) -> Any:
        async def slowly(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
            if msg.get("op") == "step" and "open" in msg:
                with trio.move_on_after(1.5):  # past the probe's first look (0.5 s)
                    await slow.wait()
            return await handle(caller, msg)
        return slowly

    net.faults["b"] = slow_b
    gen = generator(net, 2 * FAST_START_RTT_MS)
    assert await tokens(gen) == reference
    assert gen.fitness.snapshot() == {}


async def test_a_session_opening_with_a_step_needs_its_owners_delegation(
        net: FakeNet) -> None:
    """A peer cannot open sessions on c in the gateway's name (on its account): without the
    gateway's delegation to c, or with one to another peer, the open is refused."""
    c = net.servers["c"]
    thief = Issuer(create_new_key_pair(), NETWORK)
    x = np.zeros((1, 64), np.float32)
    for delegation in (b"", thief.issue("c", 60), GW.issue("b", 60)):
        opening = Open("s.2", "m", 3, 4, False, True, 16, 0, thief.peer_id, SamplingParams(),
                       delegation=delegation)
        step = Step("s.2", 0, x, "f32", (1,), Forward("t", (), GW.peer_id), open=opening)
        async with net.running():
            with pytest.raises(Refusal):
                await c._open_with_step(thief.peer_id, GW.peer_id, step)
    assert c.sessions == {}


async def test_the_first_chunk_of_a_far_route_is_spot_checked_after_the_generation(
        served: dict[str, Served], reference: list[int]) -> None:
    """Every hop drawn: b's first chunk is recomputed by its replica b2 from the rows b
    shows, and passes; c's layer has no other holder (unchecked, as the status says)."""
    net = FakeNet({GW.peer_id: served["gw"], "b": served["b"], "c": served["c"],
                   "b2": served["b2"]}, me=GW.peer_id)
    gen = generator(net, 2 * FAST_START_RTT_MS, stage_rate=1.0, expert_rate=0.0, tolerance=1e-3)
    assert await tokens(gen) == reference
    stages = gen.spot.stages
    assert (stages.seen, stages.checked, stages.unchecked, stages.caught) == (2, 1, 1, 0), \
        gen.spot.status()


class LyingOnChunks(StageServer):
    """A stage that computes each forwarded prompt chunk on garbage in place of the rows it
    was sent (what a far route's first chunk is), writing down what it really got."""

    rng = np.random.default_rng(5)

    async def _step(self, s: Any, m: Any, *rest: Any) -> Any:
        if m.forward is not None and m.dt != "i32" and len(m.x) > 1:
            m = dataclasses.replace(m, x=self.rng.permutation(m.x, axis=1))
        return await super()._step(s, m, *rest)


@pytest.fixture(scope="module")
def b3(model: Path) -> Iterator[Served]:
    """A third holder of b's layers: a second opinion when b2's disagrees with b."""
    served = Served.build([model], Holdings(windows=((1, 3),)), threads=1, kv_slots=256,
                          remote=no_experts)
    yield served
    served.close()


async def test_a_stage_lying_on_the_first_chunk_of_a_far_route_is_caught_and_unpaid(
        served: dict[str, Served], b3: Served) -> None:
    net = FakeNet({GW.peer_id: served["gw"], "b": served["b"], "c": served["c"],
                   "b2": served["b2"], "b3": b3}, me=GW.peer_id, servers={"b": LyingOnChunks})
    gen = generator(net, 2 * FAST_START_RTT_MS, stage_rate=1.0, expert_rate=0.0, tolerance=1e-3)
    net_tokens = await tokens(gen)
    assert len(net_tokens) == 10  # the output was sent before the check: not replayed
    spot = gen.spot
    assert spot.stages.caught == 1 and [e.peer for e in spot.evidence] == ["b"]
    assert spot.evidence[0].kind == "stage" and set(spot.evidence[0].checkers) == {"b2", "b3"}
    assert gen.fitness.lied("b")
    assert "b" not in {w.peer for w in gen.work(next(iter(gen._work)))}


async def test_a_step_sent_on_two_paths_is_computed_once(net: FakeNet) -> None:
    """A far peer gets small steps on both its lane and its libp2p stream: the second copy
    of a forwarded step (same owner, session and ticket) is dropped unseen."""
    gen = generator(net, 2 * FAST_START_RTT_MS)
    c = net.servers["c"]
    sent: list[dict[str, Any]] = []
    twice = net._sender("b")

    async def both(peer: str, msg: dict[str, Any]) -> None:
        if peer == "c" and msg.get("op") == "step":
            sent.append(msg)
            await twice(peer, msg)
        await twice(peer, msg)

    net.servers["b"].send = both
    tokens_out = await tokens(gen)
    assert len(tokens_out) == 10 and sent
    assert c.twins == len(sent) and c.forwarded == len(sent)


class Path2:
    """One path to a peer (rpc.Channel's notify_frame), failing when told to."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.got, self.failed = fails, [], False

    async def notify_frame(self, data: bytes, wait_s: float) -> None:
        if self.fails:
            raise HopFailed("p", "the stream broke")
        self.got.append(data)

    def fail(self) -> None:
        self.failed = True


async def test_a_message_on_two_paths_fails_only_when_both_do() -> None:
    channels = Channels(None, twin=lambda peer: True)  # type: ignore[arg-type]
    lane, stream = Path2(fails=True), Path2(fails=False)
    await channels._twice("p", (lane, stream), b"frame", 1.0)  # type: ignore[arg-type]
    assert stream.got == [b"frame"] and lane.failed and channels.twinned == 1
    with pytest.raises(HopFailed):
        await channels._twice("p", (Path2(True), Path2(True)), b"frame", 1.0)  # type: ignore[arg-type]
