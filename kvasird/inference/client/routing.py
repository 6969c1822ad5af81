"""Routes through the swarm, computed from the coverage map and our own measurements. Pure.

A route is a chain of hops that turns token ids into the next token:

    tokens ─▶ [embed][layers a0..a1) ─▶ [layers a1..a2) ─▶ … ─▶ [layers ..L)[head] ─▶ token

Each hop is one peer computing a contiguous part: optionally the embedding (it holds the
head unit), one of its held layer windows, optionally the output head. A peer holding
the head and the first window does both in one hop; the head at the end may come back
to a head holder (a ring). Routing is a shortest path over layer boundaries 0..L with
a start (tokens) and an end (sampled token): an edge per usable hop, weighted by the
expected time of that hop — our measured latency to the peer (the EWMA of step times
we saw, else the heartbeat RTT) plus a per-layer compute estimate. Unfit peers (failed,
timed out, caught by a spot check) get no edges. A hop enters a window at its start or
at any boundary inside it, and runs to its end: so windows that overlap ([0, 15) and
[10, 30)) still chain, and whenever every layer has an online holder a route exists (the
market's replicas need not line up). A peer serves such a part of a window from the
stage it loaded (Stage.part).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass

import trio

from kvasird.market.records import CoverageRecord, Holding
from kvasird.model.manifest import Unit

DEFAULT_LATENCY_MS = 25.0
"""Assumed for a peer we have no measurement of yet."""
EWMA = 0.3
PER_HOP_MS = 0.3
"""What a hop costs besides its peer's latency and layers: receiving, decoding and handing
on a step, and a graph run of its own (traced per hop, steptrace: see the per-hop
breakdown of bench/bench_swarm.py). It makes the planner take fewer hops when all else is
equal, e.g. ending at a last stage that holds the head rather than going back to ours."""


@dataclass(frozen=True)
class PeerHoldings:
    """What one peer serves now (its online holdings only)."""

    peer: str
    """Peer id."""
    head: bool
    """Holds the head (embedding and output)."""
    windows: tuple[tuple[int, int], ...]
    """Layer runs [a, b) it serves as stages."""
    experts: tuple[tuple[int, int, int], ...]
    """(layer, e0, e1) expert ranges it serves as a worker."""

    @classmethod
    def of_record(
        cls, record: CoverageRecord, proven: Container[Unit] | None = None
    ) -> PeerHoldings:
        """Its online holdings; only the units in ``proven`` when given (market.proofs)."""
        online = [h for h in record.holdings if h.state == "online"]
        if proven is not None:
            online = [
                Holding(h.kind, h.start, a, b, h.state) for h in online for a, b in _runs(h, proven)
            ]
        windows = _merge([(h.lo, h.hi) for h in online if h.kind == "L"])
        experts = tuple((h.start, h.lo, h.hi) for h in online if h.kind == "E")
        return cls(record.peer, any(h.kind == "H" for h in online), windows, experts)


def _runs(h: Holding, proven: Container[Unit]) -> list[tuple[int, int]]:
    """The [lo, hi) runs of a holding whose units are all in ``proven``."""
    out: list[tuple[int, int]] = []
    for i, u in zip(range(h.lo, h.hi), h.units(), strict=True):
        if u in proven:
            if out and out[-1][1] == i:
                out[-1] = (out[-1][0], i + 1)
            else:
                out.append((i, i + 1))
    return out


def _merge(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


@dataclass(frozen=True)
class Hop:
    """One peer's part of a route."""

    peer: str
    """Who computes it."""
    first: int
    """First layer of its window (== end when it computes no layers)."""
    end: int
    """One past its last layer."""
    embed: bool
    """Starts from token ids."""
    head: bool
    """Ends with the output head and samples."""


@dataclass(frozen=True)
class Route:
    hops: tuple[Hop, ...]
    """In order; the first embeds, the last samples."""
    cost_ms: float
    """Expected time of one decode step along it."""

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(h.peer for h in self.hops)


def plan_route(
    n_layer: int,
    holders: Sequence[PeerHoldings],
    cost: Callable[[str], float],
    per_layer_ms: float = 0.1,
    per_hop_ms: float = PER_HOP_MS,
) -> Route | None:
    """The cheapest route over `holders`, or None when they do not cover the model."""
    start, end = -1, n_layer + 1
    edges: dict[int, list[tuple[float, int, Hop]]] = {}

    def edge(a: int, b: int, hop: Hop) -> None:
        w = cost(hop.peer) + per_layer_ms * (hop.end - hop.first) + per_hop_ms
        edges.setdefault(a, []).append((w, b, hop))

    for h in holders:
        if h.head:
            edge(start, 0, Hop(h.peer, 0, 0, True, False))
            edge(n_layer, end, Hop(h.peer, n_layer, n_layer, False, True))
        for a, b in h.windows:
            for a_in in range(a, b):  # enter at the start or at any boundary inside
                edge(a_in, b, Hop(h.peer, a_in, b, False, False))
                if h.head and b == n_layer:
                    edge(a_in, end, Hop(h.peer, a_in, b, False, True))
            if h.head and a == 0:
                edge(start, b, Hop(h.peer, 0, b, True, False))
            if h.head and a == 0 and b == n_layer:
                edge(start, end, Hop(h.peer, 0, b, True, True))
    best: dict[int, tuple[float, tuple[Hop, ...]]] = {start: (0.0, ())}
    heap: list[tuple[float, int, int]] = [(0.0, 0, start)]
    tie = 0
    while heap:
        d, _, node = heapq.heappop(heap)
        if node == end:
            return Route(best[end][1], d)
        if d > best[node][0]:
            continue
        for w, nxt, hop in edges.get(node, ()):
            nd = d + w
            if nxt not in best or nd < best[nxt][0]:
                best[nxt] = (nd, best[node][1] + (hop,))
                tie += 1
                heapq.heappush(heap, (nd, tie, nxt))
    return None


def uncovered(n_layer: int, holders: Iterable[PeerHoldings]) -> list[str]:
    """What no holder in `holders` serves, for an error a person can act on, layers
    counted inclusively as the status page shows holdings: ["head", "layer 7",
    "layers 10-19", ...]; empty when they cover the model."""
    holders = list(holders)
    served = [False] * n_layer
    for h in holders:
        for a, b in h.windows:
            for layer in range(a, min(b, n_layer)):
                served[layer] = True
    gaps = [] if any(h.head for h in holders) else ["head"]
    layer = 0
    while layer < n_layer:
        if served[layer]:
            layer += 1
            continue
        end = layer
        while end < n_layer and not served[end]:
            end += 1
        gaps.append(f"layer {layer}" if end == layer + 1 else f"layers {layer}-{end - 1}")
        layer = end
    return gaps


def expert_holders(
    holders: Iterable[PeerHoldings], layer: int, lo: int, hi: int
) -> list[tuple[str, int, int]]:
    """(peer, e0, e1) of every advertised range of `layer` overlapping [lo, hi)."""
    return [
        (h.peer, e0, e1)
        for h in holders
        for lay, e0, e1 in h.experts
        if lay == layer and e0 < hi and lo < e1
    ]


AVOIDED_MS = 60_000.0
"""What a route or an expert cover counts for each peer avoided after failing, when only
such routes exist: enough that every one over fit peers is cheaper."""


def cover_experts(
    ranges: Sequence[tuple[str, int, int]], lo: int, hi: int, cost: Callable[[str], float]
) -> list[tuple[str, int, int, int, int]] | None:
    """Pieces (peer, piece_lo, piece_hi, peer_e0, peer_e1) covering [lo, hi), cheapest first.

    Greedy left to right: at each expert, the cheapest holder covering it takes as much
    as it holds. None when some expert has no holder.
    """
    out, e = [], lo
    while e < hi:
        here = [r for r in ranges if r[1] <= e < r[2]]
        if not here:
            return None
        peer, e0, e1 = min(here, key=lambda r: (cost(r[0]), -r[2]))
        out.append((peer, e, min(e1, hi), e0, e1))
        e = min(e1, hi)
    return out


class Fitness:
    """Peers that failed or were caught lying get no work until their sentence ends.

    The sentence fits the failure: a peer caught lying (a spot check, a quorum of
    accusers) is avoided for unfit_s at once (``mark``); a peer that failed at work
    (``failed``: a timeout, a broken stream, a refusal) first for a short while, doubling
    with each failure in a row up to unfit_s, and forgiven once it works again
    (``healthy``), so a restarted peer is back within seconds, a flapping one is not. A
    peer that restarted (``restarted``: its record carries a new boot id) starts afresh,
    unless it was caught lying. Sentences run on trio's clock (a test's MockClock jumps
    them to their end)."""

    def __init__(self, unfit_s: float) -> None:
        self.unfit_s = unfit_s
        self._until: dict[str, tuple[float, str]] = {}
        self._lied: set[str] = set()
        """Peers whose sentence is for lying: a restart does not end it."""
        self.strikes: dict[str, int] = {}
        """Peer -> failures at work in a row (cleared by ``healthy``)."""

    def mark(
        self, peer: str, reason: str, for_s: float | None = None, *, lied: bool = True
    ) -> None:
        """`peer` is avoided for_s (default unfit_s): for a lie (kept across its restarts)
        or, with ``lied=False``, for a passing state such as being busy."""
        self._sentence(peer, reason, self.unfit_s if for_s is None else for_s)
        if lied:
            self._lied.add(peer)

    def failed(self, peer: str, reason: str, first_s: float) -> None:
        """`peer` failed at work: avoided first_s, twice as long for each failure in a row."""
        strikes = self.strikes[peer] = self.strikes.get(peer, 0) + 1
        self._sentence(peer, reason, min(self.unfit_s, first_s * 2.0 ** (strikes - 1)))

    def _sentence(self, peer: str, reason: str, for_s: float) -> None:
        until = trio.current_time() + for_s
        if peer not in self._until or self._until[peer][0] < until:
            self._until[peer] = (until, reason)

    def restarted(self, peer: str) -> bool:
        """`peer` started a new process: forgive its failures (not its lies). True when a
        sentence was lifted."""
        self.strikes.pop(peer, None)
        if peer in self._lied and not self.fit(peer):
            return False
        self._lied.discard(peer)
        return self._until.pop(peer, None) is not None

    def healthy(self, peer: str) -> None:
        """`peer` did its work: its next failure starts from the short sentence again."""
        self.strikes.pop(peer, None)

    def lied(self, peer: str) -> bool:
        """Whether `peer` is serving a sentence for a lie (never routed to as a last resort)."""
        return peer in self._lied and not self.fit(peer)

    def pardon(self, peer: str) -> None:
        """`peer`, avoided after failing, did its work as the last resort: fit again (a
        liar's sentence stands), so that the next call does not take the last resort's
        pause for it."""
        self.strikes.pop(peer, None)
        if peer not in self._lied:
            self._until.pop(peer, None)

    def second_chance(self, peer: str) -> bool:
        """Whether `peer` may be used as a last resort when no fit peer can do the work:
        fit, or avoided after failing once (a slow or just restarted peer beats none),
        never a liar."""
        return self.fit(peer) or (not self.lied(peer) and self.strikes.get(peer, 0) <= 1)

    def fit(self, peer: str) -> bool:
        until = self._until.get(peer)
        if until is None:
            return True
        if until[0] < trio.current_time():
            del self._until[peer]
            self._lied.discard(peer)
            return True
        return False

    def snapshot(self) -> dict[str, str]:
        now = trio.current_time()
        return {p: r for p, (until, r) in list(self._until.items()) if until >= now}


class Latency:
    """Our own measurements of each peer: EWMA of answered requests, else heartbeat RTT."""

    def __init__(self, me: str, rtt: Callable[[str], float | None]) -> None:
        self.me, self.rtt = me, rtt
        self._ewma: dict[str, float] = {}

    def observe(self, peer: str, ms: float) -> None:
        old = self._ewma.get(peer)
        self._ewma[peer] = ms if old is None else (1 - EWMA) * old + EWMA * ms

    def __call__(self, peer: str) -> float:
        if peer == self.me:
            return 0.0
        if (seen := self._ewma.get(peer)) is not None:
            return seen
        rtt = self.rtt(peer)
        return DEFAULT_LATENCY_MS if rtt is None else rtt
