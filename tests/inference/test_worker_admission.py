"""Who an expert worker computes for: the gateways whose signed delegations a request
carries (each hop keeps its gateway's from the open), each admitted for the units of its
own rows, before any row is looked at; and what the transport lets a caller send before it
is admitted (real libp2p hosts)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from kvasird.compute.kv.keys import PAGE
from kvasird.errors import WireError
from kvasird.identity import load_node_key
from kvasird.inference.client.dispatch import ExpertDispatcher
from kvasird.inference.client.hotcache import HotExperts
from kvasird.inference.client.routing import Fitness, Latency, PeerHoldings
from kvasird.inference.errors import Refusal
from kvasird.inference.protocol import EXPERT_PROTOCOL, tensors
from kvasird.inference.protocol.delegation import Issuer, Verifier
from kvasird.inference.protocol.experts import ADMITTED_S, selections
from kvasird.inference.server.engine import Holdings, Served
from kvasird.inference.server.experts import ExpertServer
from kvasird.inference.server.stage import StageServer
from kvasird.inference.stepcontext import COMPANY, TALLY, Company, Tally
from kvasird.inference.transport.channel import Channels, serve
from kvasird.wire.rpc import SMALL_FRAME, Intake
from tests.support import Clock

from .conftest import N_EXPERT, N_LAYER
from .fakenet import NETWORK
from .test_channel import pair
from .test_serving import direct, open_msg

STAGE, GW1, GW2 = (Issuer(create_new_key_pair(), NETWORK) for _ in range(3))


class Admissions:
    """An admission hook that records what it was asked, refusing the gateways in `refuse`."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.asked: list[tuple[str, int]] = []
        self.refuse = refuse

    async def __call__(self, gateway: str, units: int) -> None:
        self.asked.append((gateway, units))
        if gateway in self.refuse:
            raise Refusal("unpaid", f"{gateway} is not staked")


def server(worker: Served, admit: Admissions,
           clock: Callable[[], float] = time.monotonic) -> ExpertServer:
    return ExpertServer(lambda: worker, window_s=0, wire_dtype="f32",
                        delegations=Verifier(NETWORK), admit=admit, clock=clock)


def request(rows: np.ndarray, ids: np.ndarray, groups: Any) -> dict[str, Any]:
    msg = {"op": "experts", "layer": 1, "first": 0, "rows": tensors.encode(rows, "f32"),
           "ids": tensors.encode(ids, "i32")}
    return msg if groups is None else {**msg, "for": groups}


def rows_of(worker: Served, n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, worker.hp.n_embd)).astype(np.float32)


@pytest.mark.parametrize("groups", [None, []])
async def test_a_request_that_names_no_gateway_is_refused(worker: Served, groups: Any) -> None:
    admit = Admissions()
    experts = server(worker, admit)
    with pytest.raises(Refusal, match="names no gateway") as exc:
        await experts.handle(STAGE.peer_id, request(rows_of(worker, 1), np.array([[1, 2]]),
                                                    groups))
    assert exc.value.code == "unpaid" and admit.asked == [] and experts.rows == 0


async def test_bare_gateway_names_prove_nothing_and_are_refused(worker: Served) -> None:
    """The worker's own id, or a staked gateway's, named without its signature."""
    experts = server(worker, Admissions())
    for names in (["worker-itself"], [GW1.peer_id], [[GW1.peer_id, 1]]):
        with pytest.raises(WireError, match="experts.for"):
            await experts.handle(STAGE.peer_id, request(rows_of(worker, 1), np.array([[1, 2]]),
                                                        names))
    assert experts.rows == 0


async def test_a_bad_delegation_is_refused_before_the_rows_are_looked_at(
        worker: Served) -> None:
    """Another stage's delegation, or one signed by the caller in a gateway's name: refused
    for that, not for the NaN rows it came with (they were never widened)."""
    admit = Admissions()
    experts = server(worker, admit)
    nan = np.full((1, worker.hp.n_embd), np.nan, np.float32)
    thief = Issuer(create_new_key_pair(), NETWORK)
    with pytest.raises(Refusal, match="names another stage"):
        await experts.handle(thief.peer_id, request(nan, np.array([[1, 2]]),
                                                    [[GW1.issue(STAGE.peer_id, 60), 1]]))
    forged = GW1.issue(thief.peer_id, 60)
    forged = forged[:-64] + thief.key.private_key.sign(b"kvasir-delegation-v1\n" + forged[:-64])
    with pytest.raises(Refusal, match="not signed by gateway"):
        await experts.handle(thief.peer_id, request(nan, np.array([[1, 2]]), [[forged, 1]]))
    assert admit.asked == [] and not experts.admitted(thief.peer_id)
    with pytest.raises(WireError, match="contains NaN"):  # a good delegation: then the rows
        await experts.handle(STAGE.peer_id, request(nan, np.array([[1, 2]]),
                                                     [[GW1.issue(STAGE.peer_id, 60), 1]]))


async def test_each_gateway_is_admitted_once_for_the_units_of_its_own_rows(
        worker: Served) -> None:
    """Rows of two sessions of GW1 and one of GW2: GW1 is admitted for the experts its
    rows selected (the count the stage keeps), GW2 for its own; a gateway refused fails
    the request and nothing is computed."""
    ids = np.array([[1, 2], [3, 3], [4, 5], [6, 6]])
    g1a, g1b = GW1.issue(STAGE.peer_id, 60), GW1.issue(STAGE.peer_id, 120)
    groups = [[g1a, 1], [GW2.issue(STAGE.peer_id, 60), 2], [g1b, 1]]
    admit = Admissions()
    experts = server(worker, admit)
    assert not experts.admitted(STAGE.peer_id)
    reply = await experts.handle(STAGE.peer_id, request(rows_of(worker, 4), ids, groups))
    assert admit.asked == [(GW1.peer_id, selections(ids[:1]) + selections(ids[3:])),
                           (GW2.peer_id, selections(ids[1:3]))] == [(GW1.peer_id, 3),
                                                                    (GW2.peer_id, 3)]
    assert tensors.decode(reply["out"], "out", ("f32",), (4, 2, None)).shape[0] == 4
    assert experts.admitted(STAGE.peer_id) and experts.rows == 4
    refusing = server(worker, Admissions(frozenset({GW2.peer_id})))
    with pytest.raises(Refusal, match="not staked"):
        await refusing.handle(STAGE.peer_id, request(rows_of(worker, 4), ids, groups))
    assert refusing.rows == 0 and not refusing.admitted(STAGE.peer_id)


async def test_a_caller_stays_admitted_for_admitted_s_after_its_last_admitted_request(
        worker: Served) -> None:
    clock = Clock()
    experts = server(worker, Admissions(), clock)
    await experts.handle(STAGE.peer_id, request(rows_of(worker, 1), np.array([[1, 2]]),
                                                [[GW1.issue(STAGE.peer_id, 60), 1]]))
    clock.now += ADMITTED_S - 1
    assert experts.admitted(STAGE.peer_id)
    clock.now += 1
    assert not experts.admitted(STAGE.peer_id)


async def test_a_stage_works_for_a_sessions_owner_and_the_hop_before_it_only(
        moe: Path, worker: Served) -> None:
    served = Served.build([moe], Holdings(windows=((0, 2),)), threads=1, kv_slots=4 * PAGE,
                          remote=direct(worker))
    try:
        stages = StageServer(lambda: "m", lambda: served, max_sessions=4, idle_s=60,
                             wire_dtype="f32")
        assert not stages.admitted("gw")
        await stages.handle("gw", {**open_msg("s", 0, 2, False, False), "prev": "hop1"})
        assert stages.admitted("gw") and stages.admitted("hop1")
        assert not stages.admitted("stranger")
        await stages.handle("gw", {"op": "close", "sid": "s"})
        assert not stages.admitted("gw") and not stages.admitted("hop1")
    finally:
        served.close()


async def test_rows_of_several_gateways_go_grouped_and_a_large_first_request_goes_in_two(
        worker: Served, tmp_path: Path) -> None:
    """Over real libp2p hosts, the worker behind an Intake of its own: three sessions of two
    gateways coalesce into one message, each gateway admitted for its sessions' units and
    each session given its own outputs; a request too large for a caller the worker has not
    admitted goes as its first row, then the rest, and the next large one as one, until the
    worker has not answered for half of ADMITTED_S."""
    admit, clock = Admissions(), Clock()
    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        experts = server(worker, admit, clock)
        intake = Intake(experts.admitted)
        b.set_stream_handler(EXPERT_PROTOCOL,
                             lambda s: serve(s, experts.handle, 10, intake=intake))
        channels = Channels(a, lanes=False)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        me = Issuer(load_node_key(tmp_path / "0.key").keypair, NETWORK)
        holders = [PeerHoldings(peer, False, (), tuple((lay, 0, N_EXPERT)
                                                       for lay in range(N_LAYER)))]
        dispatcher = ExpertDispatcher(
            me, lambda: holders, channels, Latency(me.peer_id, lambda p: 1.0), Fitness(60),
            lambda layer, expert: None, timeout_s=10, wire_dtype="f32", spot_check=0,
            tolerance=0.01, hot=HotExperts(None, 0, 0), window_s=0.5, clock=clock)
        big = SMALL_FRAME // 2 // (4 * worker.hp.n_embd) + 8  # over what the dispatcher risks
        rows = rows_of(worker, big)
        gids = np.random.default_rng(0).integers(0, N_EXPERT, (big, 2))
        want = worker.run_of(1, 0).worker(1, rows, gids)
        out = await dispatcher.remote(peer, 0, 1, rows, gids)
        assert np.array_equal(out, want) and dispatcher.stats["calls"] == 2
        assert admit.asked == [(me.peer_id, selections(gids[:1])),
                               (me.peer_id, selections(gids[1:]))]
        out = await dispatcher.remote(peer, 0, 1, rows, gids)
        assert np.array_equal(out, want) and dispatcher.stats["calls"] == 3

        sessions = [Tally(GW1.peer_id, GW1.issue(me.peer_id, 60)),
                    Tally(GW2.peer_id, GW2.issue(me.peer_id, 60)),
                    Tally(GW1.peer_id, GW1.issue(me.peer_id, 60))]
        three = Company()
        three.now = 3
        parts = [(rows_of(worker, 1 + i), np.array([[1, 6], [2, 2], [0, 3]][:1 + i]))
                 for i in range(3)]
        outs: list[Any] = [None] * 3

        async def step(i: int) -> None:
            COMPANY.set(three)
            TALLY.set(sessions[i])
            outs[i] = await dispatcher.remote(peer, 0, 1, *parts[i])

        admit.asked.clear()
        async with trio.open_nursery() as inner:
            for i in range(3):
                inner.start_soon(step, i)
                await trio.sleep(0.01)  # they join in this order
        assert dispatcher.stats["calls"] == 4 and dispatcher.stats["coalesced"] == 2
        for i, (r, g) in enumerate(parts):
            assert np.array_equal(outs[i], worker.run_of(1, 0).worker(1, r, g))
            assert sessions[i].experts[peer] == selections(g)
        assert admit.asked == [
            (GW1.peer_id, sessions[0].experts[peer] + sessions[2].experts[peer]),
            (GW2.peer_id, sessions[1].experts[peer])]

        clock.now += ADMITTED_S / 2 + 1  # quiet for long enough: small frames first again
        out = await dispatcher.remote(peer, 0, 1, rows, gids)
        assert np.array_equal(out, want) and dispatcher.stats["calls"] == 6
        nursery.cancel_scope.cancel()


async def test_the_gateway_opens_each_hop_with_its_delegation_to_that_hop(
        served: dict[str, Served], reference: list[int]) -> None:
    """Every hop of a route, the gateway's own included, keeps with its session the
    gateway's delegation to it: what its expert requests carry."""
    from kvasird.config import InferenceConfig
    from kvasird.inference.api import ModelInfo
    from kvasird.inference.client.swarm import SwarmGenerator

    from .conftest import N_LAYER as DENSE_LAYERS
    from .fakenet import FakeNet
    from .test_swarm import run

    net = FakeNet({GW1.peer_id: served["gw"], "b": served["b"], "c": served["c"]},
                  me=GW1.peer_id)
    gen = SwarmGenerator(net.me, lambda: ModelInfo("m", "test", 256), lambda: DENSE_LAYERS,
                         net.holders, net, net.servers[net.me].handle,  # type: ignore[arg-type]
                         Latency(net.me, lambda p: 1.0), Fitness(300), InferenceConfig(),
                         net.inbox, issuer=GW1)
    kept: dict[str, bytes] = {}

    def look(_: int) -> None:
        for name, stages in net.servers.items():
            for s in stages.sessions.values():
                kept[name] = s.tally.delegation

    assert await run(gen, 10, look) == reference
    assert set(kept) == set(net.servers)
    for name, wire in kept.items():
        assert Verifier(NETWORK).check(wire, name).gateway == GW1.peer_id
