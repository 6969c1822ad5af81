"""Records on change and as slow keep-alives, TTLs matched to them, and suspicion of the
holders whose connections fail: the policy on its own and in the service, on virtual
clocks (time is passed in, or trio's MockClock drives the service)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import trio
from libp2p.pubsub.pb import rpc_pb2
from trio.testing import MockClock

from kvasird.config import MarketConfig
from kvasird.market.coverage import CoverageMap
from kvasird.market.gate import Stale
from kvasird.market.model import MarketModel
from kvasird.market.pacing import HERD_MIN, joins_round
from kvasird.market.publish import (
    PRESENCE_K,
    TTL_KEEPALIVES,
    Publisher,
    Suspicions,
    census,
    keepalive_s,
    participants,
    present,
    rank,
    record_ttl,
    suspect_s,
)
from kvasird.market.demand import Demand
from kvasird.market.records import Capabilities, CoverageRecord, Suspicion, compress
from kvasird.market.service import MarketService
from kvasird.model.manifest import HEAD, Unit
from kvasird.wire import pack, unpack

MODEL_ID = "ab" * 32
HEARTBEAT_S = 5.0
EPOCH = 1_800_000_000.0
L0, L1 = Unit("layer", 0), Unit("layer", 1)


def record(peer: str = "holder", seq: int = 1, ts: float = 0.0, held: dict[Unit, str] | None = None,
           ttl: float = record_ttl(HEARTBEAT_S)) -> CoverageRecord:
    held = {L0: "online"} if held is None else held
    return CoverageRecord(peer, seq, ts, ttl, "online", 1, "", (), MODEL_ID if held else "",
                          10**6, compress(held))


def test_a_record_goes_out_on_change_and_otherwise_only_as_a_keep_alive() -> None:
    every = keepalive_s(HEARTBEAT_S)
    pub = Publisher(every)
    sent = []
    for t in np.arange(0.0, 3 * every, HEARTBEAT_S):
        held = {L0: "online"} if t < 2 * every else {L0: "online", L1: "joining"}
        r = record(seq=int(t) + 1, ts=t, held=held)
        if pub.due(r, t):
            pub.sent(r, t)
            sent.append(t)
    assert sent == [0.0, every, 2 * every]  # the first, one keep-alive, the change


def test_a_download_starting_is_one_record_not_two() -> None:
    pub = Publisher(keepalive_s(HEARTBEAT_S))
    joining = record(held={L0: "online", L1: "joining"})
    pub.sent(joining, 0.0)
    assert not pub.due(record(seq=2, ts=1.0, held={L0: "online", L1: "loading"}), 1.0)
    assert pub.due(record(seq=3, ts=2.0, held={L0: "online", L1: "online"}), 2.0)


def test_a_node_with_nothing_to_tell_stays_silent_but_tells_that_it_gave_up_its_units() -> None:
    quiet = "quiet"
    pub = Publisher(keepalive_s(HEARTBEAT_S))
    assert not pub.due(record(quiet, held={}), 0.0)
    assert not pub.due(record(quiet, held={}), 10 * record_ttl(HEARTBEAT_S))
    pub.sent(record(quiet), 1.0)
    assert pub.due(record(quiet, seq=2, held={}), 2.0)  # its units are gone: say so once
    pub.sent(record(quiet, seq=2, held={}), 2.0)
    assert not pub.due(record(quiet, seq=3, held={}), 2.0 + keepalive_s(HEARTBEAT_S))
    counted = Publisher(60.0, present=True)
    assert not counted.due(dataclasses.replace(record(quiet, held={}), state="joining"), 0.0)
    assert counted.due(record(quiet, held={}), 0.0)  # one of the silent nodes counted


def test_the_silent_nodes_are_counted_exactly_when_few_and_estimated_when_many() -> None:
    loud = [record(f"h{i}") for i in range(10)]
    few = [record(f"s{i}", held={}) for i in range(20)]
    assert participants(*census(loud + few)) == 30
    assert all(present(r.peer, census(few)[1]) for r in few)
    many = [f"s{i}" for i in range(10_000)]
    ranks = sorted(rank(p) for p in many)
    counted = [p for p in many if present(p, ranks)]
    assert len(counted) == PRESENCE_K  # the lowest hashes, whoever joins
    estimate = participants(10, sorted(rank(p) for p in counted))  # what a map sees
    assert 0.7 * 10_010 < estimate < 1.3 * 10_010


def test_the_herd_guard_lets_about_the_missing_bytes_enroll_and_leaves_small_networks_be(
        model: MarketModel) -> None:
    cmap = CoverageMap(model)
    cmap.apply(record("a", held={u: "online" for u in model.units() if u != L1}), 0.0)
    targets = Demand(model).targets(1)  # layer 1 (100 B) is missing
    rng = np.random.default_rng(0)
    go = [joins_round(model, cmap.active, targets, 10_000, 100, 1e6, 15.0, 5.0, rng)
          for _ in range(20_000)]
    assert 0.5 * 6 < sum(go) < 2 * 6  # p = 1 x 15 s / (10,000 x 5 s): one node a heartbeat
    many = Demand(model).targets(3)  # 2 more replicas of everything: many nodes' worth
    assert sum(joins_round(model, cmap.active, many, 10_000, 100, 1e6, 15.0, 5.0, rng)
               for _ in range(20_000)) > 10 * sum(go)
    assert all(joins_round(model, cmap.active, targets, HERD_MIN - 1, 100, 1e6, 15.0, 5.0, rng)
               for _ in range(100))
    full = Demand(model).targets(1)
    cmap.apply(record("b", held={L1: "online"}), 0.0)
    assert not joins_round(model, cmap.active, full, 10, 100, 1e6, 15.0, 5.0, rng)


def test_the_ttl_is_matched_to_the_keep_alive_which_slows_as_the_market_grows() -> None:
    for heartbeat in (0.5, 2.0, 5.0, 30.0):
        for n in (1, 10, 100, 1000, 10_000):
            every = keepalive_s(heartbeat, n)
            assert max(TTL_KEEPALIVES * every, 10.0) == record_ttl(heartbeat, n)
        assert keepalive_s(heartbeat, 10) == 3 * heartbeat  # a handful: repaired in seconds
        assert keepalive_s(heartbeat, 10_000) == keepalive_s(heartbeat, 1000) == 60 * heartbeat


def test_a_record_that_stops_being_kept_alive_expires_and_not_before(model: MarketModel) -> None:
    """A holder keeps its record alive on a virtual clock, then stops (its process died
    silently): the map holds it for exactly one TTL after the last keep-alive."""
    cmap, pub = CoverageMap(model), Publisher(keepalive_s(HEARTBEAT_S))
    ttl, dies = record_ttl(HEARTBEAT_S), 10 * keepalive_s(HEARTBEAT_S) + 7.0
    last = 0.0
    for t in np.arange(0.0, dies + 2 * ttl, 1.0):
        if t < dies:
            r = record(seq=int(t) + 1, ts=t)
            if pub.due(r, t):
                pub.sent(r, t)
                cmap.apply(r, t)
                last = t
        gone = cmap.expire(t)
        if t <= last + ttl:
            assert "holder" in cmap.entries and not gone, t
        else:
            assert "holder" not in cmap.entries, t
    assert last == 10 * keepalive_s(HEARTBEAT_S)


def test_a_suspected_holder_expires_unless_it_answers(model: MarketModel) -> None:
    cmap = CoverageMap(model)
    cmap.apply(record("a", seq=5), 0.0)
    cmap.apply(record("b", seq=5), 0.0)
    within = suspect_s(HEARTBEAT_S)
    assert not cmap.suspect("a", 4, 100.0 + within)  # an older view of it: already answered
    assert cmap.suspect("a", 5, 100.0 + within) and cmap.suspect("b", 5, 100.0 + within)
    cmap.apply(record("b", seq=6, ts=101.0), 101.0)  # b is alive: its newer record answers
    assert cmap.expire(100.0 + within + 1) == ["a"]
    assert "b" in cmap.entries and cmap.entries["b"].expires == 101.0 + record_ttl(HEARTBEAT_S)


def test_a_failure_seen_by_many_is_told_by_whoever_comes_first() -> None:
    rng = np.random.default_rng(0)
    seers = [Suspicions(spread_s=HEARTBEAT_S) for _ in range(8)]
    for s in seers:
        s.observed("dead", 5, 0.0, rng)
    first = min(seers, key=lambda s: s.pending["dead"][1])
    told = first.due(HEARTBEAT_S)
    assert told == [("dead", 5)]
    for s in seers:
        s.settled("dead")  # its suspicion reached the others
    assert all(not s.due(HEARTBEAT_S) for s in seers)


def test_a_suspicion_round_trips_on_the_wire() -> None:
    s = Suspicion("accuser", 7, EPOCH, "suspect", 5)
    assert Suspicion.from_wire(unpack(pack(s.to_wire()))) == s


class Gossip:
    """What the service publishes, with the virtual time it was published at."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str, dict]] = []

    def topic(self, name: str) -> str:
        return f"kvasir/test/{name}"

    async def publish(self, topic: str, data: bytes) -> bool:
        self.sent.append((trio.current_time(), topic, unpack(data)))
        return True


def service(model: MarketModel) -> MarketService:
    p2p = SimpleNamespace(peer_id="me", config_path="kvasird.toml", gossip=Gossip(),
                          addrs=lambda: [], peers=SimpleNamespace(snapshot=lambda: []),
                          reachability=SimpleNamespace(current=SimpleNamespace(verdict="unknown")))
    market = MarketService(p2p, MarketConfig(heartbeat_s=HEARTBEAT_S), model,  # type: ignore[arg-type]
                           Capabilities(), seed=0, clock=lambda: EPOCH + trio.current_time())
    market.held = {HEAD: "online"}
    return market


async def test_the_service_keeps_its_record_alive_and_answers_a_suspicion_at_once(
        model: MarketModel, autojump_clock: MockClock) -> None:
    market = service(model)
    sent = market.p2p.gossip.sent
    every = keepalive_s(HEARTBEAT_S, 1)  # a market of one
    async with trio.open_nursery() as nursery:
        nursery.start_soon(market._heartbeat)
        await trio.sleep(2.5 * every)
        assert [round(t) for t, _, _ in sent] == [0, every, 2 * every]
        assert all(r["ttl"] == record_ttl(HEARTBEAT_S, 1) for _, _, r in sent)
        suspicion = Suspicion("peer", 1, EPOCH + trio.current_time(), "me", sent[-1][2]["seq"])
        market._apply_suspicion(suspicion.to_wire(), "peer", market.clock())
        await trio.sleep(0.01)
        assert len(sent) == 4 and trio.current_time() - sent[-1][0] < 0.02  # not a beat later
        market.held[Unit("layer", 2)] = "joining"
        await market.publish()  # a change goes out as it happens
        assert len(sent) == 5
        nursery.cancel_scope.cancel()


async def test_the_service_suspects_a_holder_whose_connection_failed(
        model: MarketModel, autojump_clock: MockClock) -> None:
    market = service(model)
    connected = [SimpleNamespace(peer_id="holder")]
    market.p2p.peers = SimpleNamespace(snapshot=lambda: list(connected))
    assert market.map is not None
    market.map.apply(record("holder", seq=3, ts=EPOCH), EPOCH)  # a long TTL: a big market
    async with trio.open_nursery() as nursery:
        nursery.start_soon(market._heartbeat)
        await trio.sleep(HEARTBEAT_S / 2)
        connected.clear()  # liveness dropped it
        await trio.sleep(3 * HEARTBEAT_S)
        told = [r for _, topic, r in market.p2p.gossip.sent if topic == "suspicion"]
        assert [(r["suspect"], r["of"]) for r in told] == [("holder", 3)]
        nursery.cancel_scope.cancel()
    # its own suspicion passes the validator like anyone's: the holder leaves the map
    market._apply_suspicion(told[0], "me", market.clock())
    assert market.map.expire(market.clock() + suspect_s(HEARTBEAT_S) + 0.1) == ["holder"]


def test_records_compare_without_their_sequence_and_time() -> None:
    a = record(seq=1, ts=0.0)
    assert dataclasses.replace(a, seq=2, ts=5.0) != a
    pub = Publisher(60.0)
    pub.sent(a, 0.0)
    assert not pub.changed(dataclasses.replace(a, seq=2, ts=5.0))


def test_a_record_of_this_nodes_previous_run_is_not_taken_for_its_own(model: MarketModel) -> None:
    """A peer's map, fetched at start, still holds our record from before a restart: taken
    in, the units on our disk looked held by us already, and the restarted node took others
    (a real restart took layers 1-10 where it had held 25-4)."""
    market = service(model)
    before = dataclasses.replace(record("me", seq=3, ts=EPOCH), boot="previous")
    with pytest.raises(Stale):
        market._apply_coverage(before.to_wire(), "me", EPOCH, rpc_pb2.Message(), synced=True)
    assert market.map is not None and "me" not in market.map.entries
    ours = dataclasses.replace(record("me", seq=4, ts=EPOCH), boot=market.boot)
    market._apply_coverage(ours.to_wire(), "me", EPOCH, rpc_pb2.Message())
    assert "me" in market.map.entries


async def test_a_restarted_node_holding_nothing_replaces_its_previous_record_at_once(
        model: MarketModel, autojump_clock: MockClock) -> None:
    """Silent while it holds nothing, a restarted node would leave its previous run's record
    (its old holdings, counted as covered) in every map until that record's TTL: minutes in
    a large market. Seeing it in a peer's map, it publishes a record of its own at once."""
    market = service(model)
    market.held = {}
    sent = market.p2p.gossip.sent
    async with trio.open_nursery() as nursery:
        nursery.start_soon(market._heartbeat)
        await trio.sleep(3 * keepalive_s(HEARTBEAT_S, 1))
        assert sent == []  # nothing to tell
        before = dataclasses.replace(record("me", seq=3, ts=market.clock()), boot="previous")
        with pytest.raises(Stale):
            market._apply_coverage(before.to_wire(), "me", market.clock(), rpc_pb2.Message(),
                                   synced=True)
        await trio.sleep(0.01)
        assert len(sent) == 1 and trio.current_time() - sent[0][0] < 0.02
        now = CoverageRecord.from_wire(sent[0][2])
        assert now.boot == market.boot and now.holdings == () and now.seq > before.seq
        await trio.sleep(3 * keepalive_s(HEARTBEAT_S, 1))
        assert len(sent) == 1  # then silent again
        nursery.cancel_scope.cancel()
