"""Whom the gateway believes when a stage says the hop before it sent NaN: the accused, at
first; the accuser, once it has named two different senders lately (failover.Accusations)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from trio.testing import MockClock

from kvasird.config import InferenceConfig
from kvasird.errors import WireError
from kvasird.inference.api import ModelInfo
from kvasird.inference.client.failover import Accusations, Lied
from kvasird.inference.client.routing import Fitness, Latency
from kvasird.inference.client.swarm import SwarmGenerator
from kvasird.inference.errors import Refused
from kvasird.inference.protocol.stage import Failure, Forward, Hidden, Step, parse
from kvasird.inference.server.engine import Holdings, Served

from .conftest import N_LAYER
from .fakenet import FakeNet, Fault, Handle, no_experts
from .test_swarm import run

COST_MS = {"b": 1.0, "b2": 5.0, "c": 1.0, "c2": 5.0}
"""b and c are nearer than their replicas: routed to first."""


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[dict[str, Served]]:
    """gw: head + layer 0; b and b2: layers 1-2; c and c2: layer 3."""
    parts = {"gw": Holdings(head=True, windows=((0, 1),)), "b": Holdings(windows=((1, 3),)),
             "b2": Holdings(windows=((1, 3),)), "c": Holdings(windows=((3, 4),)),
             "c2": Holdings(windows=((3, 4),))}
    out = {name: Served.build([model], h, threads=1, kv_slots=256, remote=no_experts)
           for name, h in parts.items()}
    yield out
    for s in out.values():
        s.close()


def _gateway(net: FakeNet, fitness: Fitness) -> SwarmGenerator:
    return SwarmGenerator(net.me, lambda: ModelInfo("m", "test", 256), lambda: N_LAYER,
                          net.holders, net, net.servers[net.me].handle,  # type: ignore[arg-type]
                          Latency(net.me, lambda p: COST_MS.get(p, 1.0)), fitness,
                          InferenceConfig(step_timeout_s=3.0), net.inbox)


def _accusing(net: FakeNet, peer: str, name: Callable[[str], str] = str) -> Fault:
    """A stage that says of every forwarded step of hidden rows that its sender (as `name`
    gives it) sent NaN."""
    def fault(handle: Handle) -> Handle:
        async def accuse(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
            m = parse(msg)
            if not isinstance(m, Step) or m.forward is None or m.dt == "i32":
                return await handle(caller, msg)
            owner = m.forward.owner or caller
            await net.servers[peer].send(owner, Failure(
                m.forward.ticket, "broken", "sent NaN or infinite hidden states", name(caller)
            ).to_wire())
            return {}
        return accuse
    return fault


async def test_a_stage_that_accuses_every_sender_is_taken_for_a_liar(
        served: dict[str, Served], reference: list[int]) -> None:
    """c accuses b (believed: b is avoided), then b2 (not believed: c is avoided as a
    liar); the generation completes through b2 and c2 as an undisturbed run does."""
    net, fitness = FakeNet(served), Fitness(300)
    net.faults["c"] = _accusing(net, "c")
    with trio.fail_after(60):
        assert await run(_gateway(net, fitness), 10) == reference
    assert set(fitness.snapshot()) == {"b", "c"}
    assert fitness.lied("c") and not fitness.lied("b")
    assert "accused 2 different peers" in fitness.snapshot()["c"]
    assert fitness.fit("b2") and fitness.fit("c2")


async def test_an_accusation_of_a_peer_that_sent_nothing_blames_the_accuser(
        served: dict[str, Served], reference: list[int]) -> None:
    """b names c, the hop after it, as the sender of its rows: b is the failed hop."""
    net, fitness = FakeNet(served), Fitness(300)
    net.faults["b"] = _accusing(net, "b", name=lambda caller: "c")
    with trio.fail_after(60):
        assert await run(_gateway(net, fitness), 10) == reference
    assert set(fitness.snapshot()) == {"b"}
    assert "sent it nothing" in fitness.snapshot()["b"]


async def test_an_honest_stage_may_name_the_same_sender_again_and_again(
        autojump_clock: MockClock) -> None:
    accusations = Accusations("gw")
    for _ in range(3):
        judged = accusations.weigh("c", "b", "NaN")
        assert isinstance(judged, Refused) and judged.peer == "b" and judged.code == "broken"
        await trio.sleep(10)


async def test_accusations_of_two_senders_far_apart_are_both_taken(
        autojump_clock: MockClock) -> None:
    accusations = Accusations("gw", within_s=60)
    assert accusations.weigh("c", "b", "NaN").peer == "b"
    await trio.sleep(61)
    assert accusations.weigh("c", "b2", "NaN").peer == "b2"
    assert isinstance(accusations.weigh("c", "b", "NaN"), Lied)


async def test_an_accusation_of_this_node_is_a_lie_and_its_own_are_taken(
        autojump_clock: MockClock) -> None:
    accusations = Accusations("gw")
    assert isinstance(accusations.weigh("c", "gw", "NaN"), Lied)
    assert accusations.weigh("gw", "b", "NaN").peer == "b"
    assert accusations.weigh("gw", "b2", "NaN").peer == "b2"


def test_only_a_forwarded_step_is_read_with_its_nan_rows() -> None:
    """The stage a forwarded step reaches checks its rows itself, knowing the sender; every
    other array is refused as it is widened (a step's, once its session is known) or read."""
    rows = np.array([[1.0, np.nan], [np.inf, 0.0]], np.float32)
    forwarded = parse(Step("s", 0, rows, "f16", forward=Forward("t", ())).to_wire())
    assert isinstance(forwarded, Step) and np.isnan(forwarded.widened().x[0, 1])
    relayed = parse(Step("s", 0, rows, "f32").to_wire())
    assert isinstance(relayed, Step)
    with pytest.raises(WireError, match="NaN or infinity"):
        relayed.widened()
    with pytest.raises(WireError, match="NaN or infinity"):
        Hidden.from_wire(Hidden(rows, "f32").to_wire())
