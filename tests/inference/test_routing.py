"""Route planning and expert coverage over coverage-map holdings (pure functions)."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from kvasird.inference.client.routing import (
    Fitness,
    Hop,
    Latency,
    PeerHoldings,
    cover_experts,
    expert_holders,
    plan_route,
    uncovered,
)
from kvasird.market.records import CoverageRecord, Holding
from tests.support import eventually_async

L = 30


def holder(peer: str, *windows: tuple[int, int], head: bool = False,
           experts: tuple[tuple[int, int, int], ...] = ()) -> PeerHoldings:
    return PeerHoldings(peer, head, tuple(windows), experts)


def flat(ms: float = 10.0):  # noqa: ANN201 - a cost function
    return lambda peer: ms


def test_three_thirds_with_the_head_on_the_first_form_a_ring() -> None:
    route = plan_route(L, [holder("a", (0, 10), head=True), holder("b", (10, 20)),
                           holder("c", (20, 30))], flat())
    assert route is not None
    assert route.hops == (Hop("a", 0, 10, True, False), Hop("b", 10, 20, False, False),
                          Hop("c", 20, 30, False, False), Hop("a", 30, 30, False, True))


def test_a_peer_holding_everything_is_one_hop() -> None:
    route = plan_route(L, [holder("a", (0, 30), head=True), holder("b", (0, 15)),
                           holder("c", (15, 30))], flat())
    assert route is not None and route.hops == (Hop("a", 0, 30, True, True),)


def test_the_faster_replica_is_chosen() -> None:
    costs = {"a": 0.0, "b1": 30.0, "b2": 3.0, "c": 5.0}
    route = plan_route(L, [holder("a", (0, 10), head=True), holder("b1", (10, 20)),
                           holder("b2", (10, 20)), holder("c", (20, 30))], costs.__getitem__)
    assert route is not None and "b2" in route.peers and "b1" not in route.peers


def test_each_hop_costs_besides_its_latency() -> None:
    """x serves all layers for 5 ms; b and c each a third for 2.4 ms: 0.2 ms less in all,
    but one hop more (a hop's own overhead, PER_HOP_MS, is more than that)."""
    costs = {"a": 0.0, "x": 5.0, "b": 2.4, "c": 2.4}
    holders = [holder("a", (0, 10), head=True), holder("x", (10, 30)), holder("b", (10, 20)),
               holder("c", (20, 30))]
    route = plan_route(L, holders, costs.__getitem__)
    assert route is not None and route.peers == ("a", "x", "a")
    free = plan_route(L, holders, costs.__getitem__, per_hop_ms=0.0)
    assert free is not None and free.peers == ("a", "b", "c", "a")


def test_windows_that_overlap_chain_by_entering_one_past_its_start() -> None:
    """What a market that counts replicas per unit leaves after a kill: [0, 15) and
    [10, 30) cover every layer but do not meet at a boundary."""
    route = plan_route(L, [holder("a", head=True), holder("b", (0, 15)), holder("c", (10, 30))],
                       flat())
    assert route is not None
    assert route.hops == (Hop("a", 0, 0, True, False), Hop("b", 0, 15, False, False),
                          Hop("c", 15, 30, False, False), Hop("a", 30, 30, False, True))
    ends_at_head = plan_route(L, [holder("a", (0, 20), head=True), holder("c", (5, 30), head=True)],
                              flat())
    assert ends_at_head is not None
    assert ends_at_head.hops == (Hop("a", 0, 20, True, False), Hop("c", 20, 30, False, True))


def test_a_gap_in_the_layers_means_no_route() -> None:
    assert plan_route(L, [holder("a", (0, 10), head=True), holder("c", (20, 30))], flat()) is None


def test_without_a_head_holder_there_is_no_route() -> None:
    assert plan_route(L, [holder("a", (0, 30))], flat()) is None


def test_what_is_uncovered_is_named_in_runs() -> None:
    assert uncovered(L, [holder("a", (0, 10), head=True), holder("c", (20, 30)),
                         holder("d", (24, 26))]) == ["layers 10-19"]
    assert uncovered(L, [holder("a", (0, 5)), holder("b", (9, 12))]) == [
        "head", "layers 5-8", "layers 12-29"]
    # covered layer by layer: windows that overlap chain, so uncovered() == [] means a route
    overlapping = [holder("a", (0, 12), head=True), holder("b", (10, 30))]
    assert uncovered(L, overlapping) == [] and plan_route(L, overlapping, flat()) is not None


def test_online_holdings_are_read_from_a_record_and_others_ignored() -> None:
    record = CoverageRecord("p", 1, 0.0, 3.0, "online", 1, "v", (), "0" * 64, 1 << 30, (
        Holding("H", 0, 0, 1, "online"), Holding("L", 0, 0, 5, "online"),
        Holding("L", 5, 5, 8, "loading"), Holding("E", 3, 0, 16, "online")))
    h = PeerHoldings.of_record(record)
    assert h == PeerHoldings("p", True, ((0, 5),), ((3, 0, 16),))


def test_experts_are_covered_by_the_cheapest_holders_in_pieces() -> None:
    holders = [holder("w1", experts=((2, 0, 8),)), holder("w2", experts=((2, 8, 16),)),
               holder("w3", experts=((2, 0, 16),))]
    costs = {"w1": 1.0, "w2": 1.0, "w3": 9.0}
    ranges = expert_holders(holders, 2, 4, 12)
    assert cover_experts(ranges, 4, 12, costs.__getitem__) == [("w1", 4, 8, 0, 8),
                                                               ("w2", 8, 12, 8, 16)]
    costs["w3"] = 0.5
    assert cover_experts(ranges, 4, 12, costs.__getitem__) == [("w3", 4, 12, 0, 16)]


def test_uncovered_experts_have_no_cover() -> None:
    ranges = expert_holders([holder("w1", experts=((2, 0, 8),))], 2, 0, 16)
    assert cover_experts(ranges, 0, 16, flat()) is None


async def test_an_unfit_peer_serves_again_after_its_sentence(autojump_clock: MockClock) -> None:
    fitness = Fitness(unfit_s=60)
    fitness.mark("x", "timed out", for_s=5.0)
    fitness.mark("y", "spot check failed")
    assert not fitness.fit("x") and not fitness.fit("y")
    await trio.sleep(5.01)
    assert fitness.fit("x") and not fitness.fit("y")
    assert fitness.snapshot() == {"y": "spot check failed"}
    await trio.sleep(55)
    assert fitness.fit("y") and fitness.snapshot() == {}


async def test_failures_in_a_row_double_the_sentence_and_working_again_forgives_them(
        autojump_clock: MockClock) -> None:
    fitness = Fitness(unfit_s=100)
    sentences = []
    for _ in range(5):
        fitness.failed("x", "timed out", first_s=15)
        began = trio.current_time()
        await eventually_async("x serves its sentence", lambda: fitness.fit("x"), timeout=200,
                               every=1)
        sentences.append(trio.current_time() - began)
    assert [round(s) for s in sentences] == [16, 31, 61, 101, 101]  # capped at unfit_s
    fitness.healthy("x")
    fitness.failed("x", "timed out", first_s=15)
    await trio.sleep(15.5)
    assert fitness.fit("x") and fitness.strikes == {"x": 1}


async def test_a_restart_forgives_failures_but_not_lies(autojump_clock: MockClock) -> None:
    fitness = Fitness(unfit_s=300)
    for _ in range(4):
        fitness.failed("slow", "timed out", first_s=15)  # now 120 s
    fitness.mark("liar", "spot check failed")
    fitness.failed("liar", "timed out", first_s=15)  # does not shorten its 300 s
    fitness.mark("busy", "busy", 2.0, lied=False)
    assert not any(fitness.fit(p) for p in ("slow", "liar", "busy"))
    assert fitness.restarted("slow") and fitness.restarted("busy")
    assert not fitness.restarted("liar")
    assert fitness.fit("slow") and fitness.fit("busy") and fitness.strikes == {}
    await trio.sleep(299)
    assert not fitness.fit("liar")
    await trio.sleep(2)
    assert fitness.fit("liar")
    fitness.failed("liar", "timed out", first_s=15)  # its lie was served: a failure is a failure
    assert fitness.restarted("liar") and fitness.fit("liar")


@pytest.mark.parametrize(("seen", "rtt", "expected"), [([], None, 25.0), ([], 2.0, 2.0),
                                                      ([10.0, 20.0], 2.0, 13.0)])
def test_latency_prefers_what_we_measured_over_heartbeat_rtt(
        seen: list[float], rtt: float | None, expected: float) -> None:
    latency = Latency("me", lambda peer: rtt)
    for ms in seen:
        latency.observe("p", ms)
    assert latency("p") == pytest.approx(expected)
    assert latency("me") == 0.0
