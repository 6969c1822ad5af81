"""Prefix affinity (client.affinity): which route holds a prompt's start, and when the
gateway takes it over the cheapest one."""

from __future__ import annotations

from kvasird.compute.kv.keys import KEY_BYTES, PAGE, page_keys
from kvasird.inference.client.affinity import PrefixRoutes, hop_keys, offered, prefer, route_cost
from kvasird.inference.client.routing import Hop, PeerHoldings, Route, plan_route

N = 4
A = PeerHoldings("a", True, ((0, N),), ())
B = PeerHoldings("b", True, ((0, N),), ())


def whole(peer: str, cost: float) -> Route:
    return Route((Hop(peer, 0, N, True, True),), cost)


def test_the_longest_remembered_prefix_names_its_route() -> None:
    routes = PrefixRoutes()
    history = list(range(5 * PAGE))
    routes.remember(page_keys(history), whole("a", 1))
    again = history[:3 * PAGE + 10] + [7] * 200
    assert routes.recall(page_keys(again)) == (3 * PAGE, whole("a", 1))
    assert routes.recall(page_keys([9] * 300)) is None
    routes.remember(page_keys(again), whole("b", 1))  # the newest route of a key wins
    assert routes.recall(page_keys(history[:2 * PAGE]))[1].peers == ("b",)


def test_remembered_keys_are_bounded_and_the_first_pages_outlive_the_last() -> None:
    routes = PrefixRoutes(capacity=3)
    routes.remember(page_keys(list(range(5 * PAGE))), whole("a", 1))
    assert len(routes) == 3
    assert routes.recall(page_keys(list(range(PAGE)))) is not None


def test_a_hop_files_its_pages_under_keys_scoped_by_every_hop_before_it() -> None:
    keys = page_keys(list(range(2 * PAGE)))
    ring = Route((Hop("a", 0, 2, True, False), Hop("b", 2, N, False, True)), 1)
    other = Route((Hop("c", 0, 2, True, False), Hop("b", 2, N, False, True)), 1)
    k0, k1 = hop_keys(keys, ring, 0), hop_keys(keys, ring, 1)
    assert len(k0) == len(keys) == 2 * KEY_BYTES and k0 != k1 != keys
    assert hop_keys(keys, other, 1) != k1  # same peer and part, another upstream
    assert hop_keys(keys, ring, 1) == k1


def test_the_prefix_route_is_taken_while_it_spares_more_than_it_costs() -> None:
    best = plan_route(N, [A, B], {"a": 10.0, "b": 5.0}.get)
    assert best is not None and best.peers == ("b",)
    cost = {"a": 10.0, "b": 5.0}.get
    held = (2048, whole("a", 0))
    assert abs(route_cost(held[1], cost) - best.cost_ms - 5.0) < 1e-9
    # 100 steps x 5 ms extra = 500 ms < 2048 positions x 1 ms of prefill spared
    assert prefer(best, held, [A, B], cost, 100, 1.0).peers == ("a",)
    assert prefer(best, held, [A, B], cost, 1000, 1.0).peers == ("b",)
    assert prefer(best, held, [B], cost, 100, 1.0).peers == ("b",)  # a is gone
    assert prefer(best, None, [A, B], cost, 100, 1.0) is best


def test_a_route_is_offered_only_while_its_peers_serve_each_part() -> None:
    ring = Route((Hop("a", 0, 2, True, False), Hop("b", 2, N, False, True)), 1)
    a = PeerHoldings("a", True, ((0, 2),), ())
    assert offered(ring, [a, B])  # b enters its window inside it
    assert not offered(ring, [A, B])  # a's window now runs past the hop's end
    assert not offered(ring, [a, PeerHoldings("b", True, ((0, 3),), ())])
    assert not offered(ring, [a, PeerHoldings("b", False, ((0, N),), ())])
    assert not offered(ring, [a])
