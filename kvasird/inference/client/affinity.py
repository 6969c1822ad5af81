"""Prefix affinity: which route holds the start of a prompt, and when to take it. Pure.

Stages keep the KV pages of finished sessions (compute.kv.prefix.PrefixCache), filed under keys the
gateway sends, so a request that starts like an earlier one (an agent's system prompt and
history, sent again on every call) need compute only what follows, if it goes to the
stages that computed the earlier one:

    prompt ─▶ page_keys (one key per full page, each naming every token up to its end)
      ─▶ PrefixRoutes.recall: the route that last computed the longest run of them
      ─▶ prefer: that route, when it is still offered and its slower decode steps cost
         less than the prefill it spares; else the cheapest route
      ─▶ hop_keys(keys, route, i): what hop i files and finds the pages under

A hop's KV depends on every hop before it, not only on the tokens: hop i's keys are the
token keys scoped by the peers and parts of hops 0..i, so a stage reuses a page only
behind the same upstream (a page computed behind a peer later found broken is never
served behind another), and a repeated prompt on the same route computes what a cold one
would, bit for bit (the prefill starts at a page boundary: swarm.py's ``start``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvasird.compute.kv.keys import KEY_BYTES, PAGE
from kvasird.inference.client.routing import PER_HOP_MS, PeerHoldings, Route

REMEMBERED_KEYS = 1 << 16
"""Page keys whose last route a gateway remembers (~100 bytes each)."""
PREFILL_MS_PER_TOKEN = 1.0
"""Assumed prefill time per prompt token until one is measured."""


def hop_keys(keys: bytes, route: Route, i: int) -> bytes:
    """Token page keys as hop i of `route` files them: scoped by hops 0..i."""
    seed = hashlib.blake2b(
        repr([(h.peer, h.first, h.end, h.embed, h.head) for h in route.hops[: i + 1]]).encode(),
        digest_size=KEY_BYTES,
    ).digest()
    return b"".join(
        hashlib.blake2b(seed + keys[j : j + KEY_BYTES], digest_size=KEY_BYTES).digest()
        for j in range(0, len(keys), KEY_BYTES)
    )


class PrefixRoutes:
    """The route that last computed each page key this gateway sent, least recent first."""

    def __init__(self, capacity: int = REMEMBERED_KEYS) -> None:
        self.capacity = capacity
        self._routes: OrderedDict[bytes, Route] = OrderedDict()

    def __len__(self) -> int:
        return len(self._routes)

    def remember(self, keys: bytes, route: Route) -> None:
        """`route` computed the pages `keys` name (page_keys of a finished session)."""
        for j in range(len(keys) - KEY_BYTES, -1, -KEY_BYTES):  # the first page freshest
            key = keys[j : j + KEY_BYTES]
            self._routes[key] = route
            self._routes.move_to_end(key)
        while len(self._routes) > self.capacity:
            self._routes.popitem(last=False)

    def recall(self, keys: bytes) -> tuple[int, Route] | None:
        """(prompt positions, route) of the longest run of `keys` a remembered route holds."""
        for j in range(len(keys) - KEY_BYTES, -1, -KEY_BYTES):
            route = self._routes.get(keys[j : j + KEY_BYTES])
            if route is not None:
                return (j // KEY_BYTES + 1) * PAGE, route
        return None


def offered(route: Route, holders: Sequence[PeerHoldings]) -> bool:
    """Whether every hop of `route` is still served by its peer among `holders`."""
    by_peer = {h.peer: h for h in holders}
    for hop in route.hops:
        h = by_peer.get(hop.peer)
        if h is None or (hop.embed or hop.head) and not h.head:
            return False
        if hop.end > hop.first and not any(a <= hop.first < b == hop.end for a, b in h.windows):
            return False
    return True


def route_cost(
    route: Route,
    cost: Callable[[str], float],
    per_layer_ms: float = 0.1,
    per_hop_ms: float = PER_HOP_MS,
) -> float:
    """A route's expected decode step (ms), as plan_route weighs its edges."""
    return sum(cost(h.peer) + per_layer_ms * (h.end - h.first) + per_hop_ms for h in route.hops)


def prefer(
    best: Route,
    recalled: tuple[int, Route] | None,
    holders: Sequence[PeerHoldings],
    cost: Callable[[str], float],
    steps: int,
    prefill_ms_per_token: float,
) -> Route:
    """The route to take: the one holding the prompt's prefix when it is still offered and
    its decode steps, `steps` of them, cost less extra time than the prefill it spares;
    else `best`."""
    if recalled is None:
        return best
    positions, route = recalled
    if route.hops == best.hops or not offered(route, holders):
        return best
    extra_ms = (route_cost(route, cost) - best.cost_ms) * steps
    return route if extra_ms <= positions * prefill_ms_per_token else best
