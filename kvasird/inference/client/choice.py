"""ExpertChoice: per MoE layer and per step, our own copy of the experts or the workers.

A window stage that holds all of a layer's experts (a fallback replica) while other peers
serve them too may send the layer's rows out or compute them itself. The round trip to a
worker is paid once per layer (the router of layer l+1 needs layer l's output, so the
layers of one step cannot go out together), so the workers pay only where their round
trip plus their compute beats ours: a slow stage beside fast workers on a LAN; never a
stage with its own copy across a WAN link. Decided per step, for its row count, from what
was measured:

    ours     the stage's own expert FFN timed on this node (Stage.probe) for the step's
             row bucket, again every PROBE_EVERY choices (it moves with the node's load)
    theirs   per worker of the cheapest cover (routing.cover_experts), the round trip
             of its answered calls for that row bucket (`observed`, by the dispatcher) while
             fresh; else the heartbeat round trip plus its share of our compute (a
             worker assumed as fast as us), which is how a stale measurement is retried

The workers get the layer only when theirs < MARGIN x ours (a choice that flaps costs a
graph per side). `mode` overrides: "fallback" never sends an offered layer out, "remote"
always does while a fit cover exists (a benchmark's comparison, an operator's wish).
What was chosen is counted per layer and step run alone (`counts`: fallback, remote; the
dispatcher adds cache, a call its cached experts answered whole); steps batched with other
sessions' compute the offered layers on the stage's copy and are not counted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from kvasird.compute.stage import PREFILL_PIECE, Stage, held_now
from kvasird.inference.client.routing import (
    Fitness,
    Latency,
    PeerHoldings,
    cover_experts,
    expert_holders,
)

MARGIN = 0.8
"""The workers' estimate must be under this share of ours to take a layer."""
PROBE_EVERY = 1024
"""Choices of one (stage, layer, rows) between two timings of our own compute."""
FRESH_S = 30.0
"""How long a worker's measured round trip stands for it."""
COVER_S = 1.0
"""How long a layer's cover (who would take it) is reused between choices."""
MODES = ("auto", "fallback", "remote")


def bucket(rows: int) -> int:
    """Row counts timed alike: powers of two up to a prefill piece."""
    return 1 << (min(rows, PREFILL_PIECE) - 1).bit_length()


class ExpertChoice:
    """Stage.choose for this node's windows: which offered layers a step sends out."""

    def __init__(
        self,
        me: str,
        holders: Callable[[], list[PeerHoldings]],
        latency: Latency,
        fitness: Fitness,
        mode: str = "auto",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"expert choice must be one of {MODES}, got {mode!r}")
        self.me, self.holders, self.latency, self.fitness = me, holders, latency, fitness
        self.mode, self.clock = mode, clock
        self.counts: dict[int, Counter[str]] = {}
        """Layer -> how its steps went: fallback (our copy), remote, cache."""
        self._ours: dict[tuple[int, int, int], tuple[float, int]] = {}
        """(id of the stage's weights, layer, row bucket) -> (our ms, choices since timed)."""
        self._theirs: dict[tuple[str, int], tuple[float, float]] = {}
        """(worker, row bucket) -> (EWMA of its answered round trips ms, when last seen)."""
        self._covers: dict[int, tuple[float, list[tuple[str, int, int, int, int]] | None]] = {}
        self.last: dict[int, tuple[float, float | None]] = {}
        """Layer -> the last choice's estimates: (our ms, the workers' ms or None)."""

    def count(self, layer: int, how: str) -> None:
        self.counts.setdefault(layer, Counter())[how] += 1

    def observed(self, peer: str, rows: int, ms: float) -> None:
        """A worker answered a call of `rows` rows in `ms` (the dispatcher's measurement)."""
        key = (peer, bucket(rows))
        old = self._theirs.get(key)
        self._theirs[key] = (ms if old is None else 0.7 * old[0] + 0.3 * ms, self.clock())

    def __call__(self, stage: Stage, layers: tuple[int, ...], rows: int) -> frozenset[int]:
        if self.mode == "fallback":
            out: frozenset[int] = frozenset()
        else:
            out = frozenset(lay for lay in layers if self._send(stage, lay, rows))
        for lay in layers:
            if lay not in out:
                self.count(lay, "fallback")
        return out

    def estimates(self, stage: Stage, layer: int, rows: int) -> tuple[float, float | None]:
        """(our ms, the workers' ms or None when no fit cover exists) for `rows` rows."""
        b = bucket(rows)
        ours = self._our_ms(stage, layer, b)
        cover = self._cover(layer, stage.hp.n_expert)
        if cover is None:
            return ours, None
        now, n = self.clock(), stage.hp.n_expert
        theirs = 0.0
        for peer, lo, hi, _, _ in cover:
            seen = self._theirs.get((peer, b))
            if seen is not None and now - seen[1] < FRESH_S:
                ms = seen[0]
            else:
                rtt = self.latency.rtt(peer)
                ms = (self.latency(peer) if rtt is None else rtt) + ours * (hi - lo) / n
            theirs = max(theirs, ms)  # the pieces go out at once
        return ours, theirs

    def _send(self, stage: Stage, layer: int, rows: int) -> bool:
        if self.mode == "remote":
            return self._cover(layer, stage.hp.n_expert) is not None
        ours, theirs = self.last[layer] = self.estimates(stage, layer, rows)
        return theirs is not None and theirs < MARGIN * ours

    def _our_ms(self, stage: Stage, layer: int, b: int) -> float:
        key = (id(stage.weights), layer, b)
        known = self._ours.get(key)
        if known is not None and known[1] < PROBE_EVERY:
            self._ours[key] = (known[0], known[1] + 1)
            return known[0]
        worker = stage.local_worker()
        with held_now([worker]) as free:  # busy with a prefill: keep what we had
            if not free:
                return known[0] if known is not None else 0.0
            ms = stage.probe(layer, b) * 1000
        self._ours[key] = (ms, 0)
        return ms

    def _cover(self, layer: int, n_expert: int) -> list[tuple[str, int, int, int, int]] | None:
        now = self.clock()
        cached = self._covers.get(layer)
        if cached is not None and now - cached[0] < COVER_S:
            return cached[1]
        fit = [h for h in self.holders() if h.peer != self.me and self.fitness.fit(h.peer)]
        cover = cover_experts(expert_holders(fit, layer, 0, n_expert), 0, n_expert, self.latency)
        self._covers[layer] = (now, cover)
        return cover
