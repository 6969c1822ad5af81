from __future__ import annotations

import pytest

from kvasird.inference.steptrace import TRACES_KEPT, StepTrace, Traces

ROUTE = ("gw", "b", "gw")
# gw: local hop (received when handed over); b on another clock; gw again as the head
# [received, compute began, compute ended, handed on, experts waited (s)]
STAMPS = [[10.0, 10.0, 10.002, 10.0021, 0.0], [500.0, 500.0003, 500.0033, 500.0034, 0.0],
          [10.0060, 10.0061, 10.0066, 10.0068, 0.0]]


def test_a_trace_splits_each_hop_and_leaves_the_rest_to_the_wire() -> None:
    t = StepTrace.parse(ROUTE, 9.9995, 10.0075, STAMPS)
    assert t is not None
    assert [tuple(round(x, 3) for x in h) for h in t.hops] == [
        (0.0, 2.0, 0.1, 0.0), (0.3, 3.0, 0.1, 0.0), (0.1, 0.5, 0.2, 0.0)]
    assert t.total_ms == pytest.approx(8.0)
    assert t.wire_ms == pytest.approx(8.0 - 2.1 - 3.4 - 0.8)
    # links read across clocks are meaningless here (b's is another); on one clock they
    # split the wire: sent -> gw, gw -> b, b -> gw, gw -> result
    assert t.links[0] == pytest.approx(0.5) and t.links[-1] == pytest.approx(0.7)
    one = [STAMPS[0], [10.0025, 10.0028, 10.0058, 10.0059, 0.0], STAMPS[2]]
    t = StepTrace.parse(ROUTE, 9.9995, 10.0075, one)
    assert t is not None
    assert [round(x, 3) for x in t.links] == [0.5, 0.4, 0.1, 0.7]
    assert sum(t.links) == pytest.approx(t.wire_ms)


def test_a_hops_wait_for_remote_experts_is_part_of_its_compute() -> None:
    stamps = [STAMPS[0], [*STAMPS[1][:4], 0.0021], STAMPS[2]]
    t = StepTrace.parse(ROUTE, 9.9995, 10.0075, stamps)
    assert t is not None and round(t.hops[1][3], 3) == 2.1
    assert t.wire_ms == pytest.approx(8.0 - 2.1 - 3.4 - 0.8)  # counted once, in compute
    # waiting longer than computing, or a negative wait, is not a trace
    for wait in (0.0031, -0.001):
        assert StepTrace.parse(ROUTE, 9.9995, 10.0075,
                               [STAMPS[0], [*STAMPS[1][:4], wait], STAMPS[2]]) is None


@pytest.mark.parametrize("stamps", [
    None, [], STAMPS[:2], [*STAMPS[:2], [1.0, 2.0, 3.0, 4.0]],
    [*STAMPS[:2], [1.0, 2.0, 3.0, "4", 0.0]], [*STAMPS[:2], [1.0, 2.0, 3.0, 4, 0.0]],
    [*STAMPS[:2], [1.0, 3.0, 2.0, 4.0, 0.0]], "x" * 10])
def test_stamps_that_are_not_one_ordered_set_per_hop_are_ignored(stamps: object) -> None:
    assert StepTrace.parse(ROUTE, 0.0, 1.0, stamps) is None


def test_the_summary_is_of_the_latest_route_and_keeps_a_bounded_window() -> None:
    traces = Traces()
    assert traces.summary() == {}
    traces.add(StepTrace.parse(("x",), 0.0, 1.0, [[0.0, 0.1, 0.2, 0.3, 0.0]]))
    traces.add(None)
    for i in range(TRACES_KEPT + 5):
        traces.add(StepTrace.parse(ROUTE, 9.9995, 10.0075 + i * 1e-4, STAMPS))
    view = traces.summary()
    assert view["route"] == list(ROUTE) and view["steps"] == TRACES_KEPT
    assert [h["compute_ms"] for h in view["hops"]] == [2.0, 3.0, 0.5]
    assert view["total_ms"] == pytest.approx(8.0 + (TRACES_KEPT // 2 + 5) * 0.1, abs=0.06)
