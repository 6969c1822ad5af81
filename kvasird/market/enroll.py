"""decide(): which units this node should hold, from the map it sees. Pure.

Scarcest first (and among equally scarce, the largest unit first): fill the budget with
units whose replicas are short of their target, taking contiguous runs (one range per
layer keeps records small and dispatch cheap), starting at a random offset so nodes
deciding at the same moment spread out.
Hysteresis: a node gives a unit up only to make room for a scarcer one, only where the
unit has more holders than its target, and only if it is one of the designated surplus
holders (the same deterministic choice on every node), so a unit is never left uncovered.
Runs are found with numpy over the whole model and made into Units only as far as the
budget reaches: a 122B MoE has 12,544 experts, and a Python loop over them made every
decision slow (bench/sim_market.py reports decide ms).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import numpy as np

from kvasird.market.coverage import Counts
from kvasird.market.demand import Targets, scarcity
from kvasird.market.model import MarketModel
from kvasird.model.manifest import HEAD, Unit

SWAP_EAGERNESS = 2.0


@dataclass(frozen=True)
class Plan:
    add: tuple[Unit, ...]
    """Units to start holding (announced as joining, then loaded)."""
    drop: tuple[Unit, ...]
    """Units to give up (announced as draining, then removed)."""


def decide(
    model: MarketModel,
    counts: Counts,
    targets: Targets,
    me: str,
    budget: int,
    held: set[Unit],
    pinned: set[Unit],
    holders: Callable[[Unit], list[str]],
    rng: np.random.Generator,
    peers: int = 1,
    stored: Set[Unit] = frozenset(),
) -> Plan:
    """``counts`` include our own holdings; ``holders(unit)`` lists the active holders.

    ``stored`` are units whose bytes are on our disk already (a restarted node's previous
    holdings): among equally scarce runs they are taken first, and a run is entered at
    them, so a restart takes back what it held where the market still wants it, with no
    download.

    ``peers`` is how many nodes take part in the market. Filling free budget is always
    done; giving a unit up to take a scarce one (a swap) is done by each node only with
    probability ``SWAP_EAGERNESS * deficit / peers``, so that a shortage of d replicas
    draws about d swaps across the network instead of one from every node at once, which
    would over-cover the scarce unit and leave what they dropped short (an oscillation
    seen with ten daemons whose loads take seconds).
    """
    add = [u for u in sorted(pinned) if u not in held]
    used = sum(model.size(u) for u in held | set(add))
    counts = _copy(counts)
    for u in add:
        _bump(counts, u)
    wanted = _scarce_runs(model, counts, targets, held | set(add), rng, stored)
    droppable = _surplus(model, counts, targets, me, held - pinned, holders)
    freeable = sum(model.size(u) for u in droppable)
    drop: list[Unit] = []
    for run in wanted:
        if used + run.smallest - freeable > budget:
            continue  # none of it fits, even in the place of all our surplus
        may_swap: bool | None = None  # drawn once a unit of the run does not fit free
        for u, size in run.units(model):
            if used + size > budget:
                if may_swap is None:
                    lead = run.unit(run.start + run.first)
                    deficit = _target(targets, lead) - counts.of(lead)
                    may_swap = bool(rng.random() < SWAP_EAGERNESS * deficit / max(peers, 1))
                if not may_swap or used + size - freeable > budget:
                    if used + run.smallest - (freeable if may_swap else 0) > budget:
                        break  # nor does any other unit of the run
                    continue
            while used + size > budget:
                victim = droppable.pop()
                drop.append(victim)
                used -= model.size(victim)
                freeable -= model.size(victim)
            add.append(u)
            used += size
    return Plan(tuple(add), tuple(drop))


def _copy(c: Counts) -> Counts:
    return Counts(c.layer.copy(), c.expert.copy(), c.head)


def _bump(c: Counts, u: Unit) -> None:
    if u.kind == "head":
        c.head += 1
    elif u.kind == "layer":
        c.layer[u.layer] += 1
    else:
        c.expert[u.layer, u.expert] += 1


_KINDS = ("head", "layer", "expert")


class _Run(NamedTuple):
    """Contiguous units of one kind and equal scarcity that we don't hold (a stretch of
    layers, or of one layer's experts), entered at ``first``. Units are made only for the
    ones ``decide`` gets to: a map where everything is scarce costs no 12,544 of them."""

    kind: str
    layer: int
    """The experts' layer (experts only)."""
    start: int
    end: int
    first: int
    """Offset of the unit taken first (the run wraps around to the ones before it)."""
    smallest: int
    """Bytes of its smallest unit."""

    def unit(self, i: int) -> Unit:
        if self.kind == "expert":
            return Unit("expert", self.layer, i)
        return Unit("layer", i) if self.kind == "layer" else HEAD

    def units(self, model: MarketModel) -> Iterator[tuple[Unit, int]]:
        """(unit, bytes) in the order to take them."""
        sizes = (
            model.expert_bytes[self.layer, self.start : self.end].tolist()
            if self.kind == "expert"
            else model.layer_bytes[self.start : self.end].tolist()
            if self.kind == "layer"
            else [model.head_bytes]
        )
        for j in chain(range(self.first, len(sizes)), range(self.first)):
            yield self.unit(self.start + j), sizes[j]


def _scarce_runs(
    model: MarketModel,
    counts: Counts,
    targets: Targets,
    held: set[Unit],
    rng: np.random.Generator,
    stored: Set[Unit] = frozenset(),
) -> list[_Run]:
    """Runs of scarce units we don't hold, scarcest first, each rotated to a random start
    (to its first stored unit when it has one)."""
    s_layer, s_expert, s_head = scarcity(counts, targets)
    mine, disk = _Mask(model, held), _Mask(model, stored)
    # per kind as rows: (scarcity, ours, bytes, on our disk)
    grids = (
        (
            np.array([[s_head]]),
            np.array([[mine.head]]),
            np.array([[model.head_bytes]]),
            np.array([[disk.head]]),
        ),
        (s_layer[None], mine.layer[None], model.layer_bytes[None], disk.layer[None]),
        (s_expert, mine.expert, model.expert_bytes, disk.expert),
    )
    found = [_group(s, ~ours, size, on) for s, ours, size, on in grids]
    kind = np.concatenate([np.full(len(f[0]), k) for k, f in enumerate(found)])
    row, start, end, level, largest, smallest, on_disk = (
        np.concatenate(c) for c in zip(*found, strict=True)
    )
    # Equally scarce: the largest unit first (first-fit decreasing). A node that filled its
    # budget with small layers first could leave no room anywhere for the head (30 of 42
    # MiB per node in the 3-node demo), and nodes only give up surplus: it stayed uncovered.
    # Before both: runs with more bytes already on our disk. Then at random.
    order = np.lexsort((rng.random(len(level)), -largest, -on_disk, -level))
    firsts = rng.integers(0, (end - start)[order]).tolist()
    out = []
    for k, r, a, b, least, disk_bytes, first in zip(
        *(c[order].tolist() for c in (kind, row, start, end, smallest, on_disk)),
        firsts,
        strict=True,
    ):
        if disk_bytes:  # enter at a stored segment's start (cyclically: a run taken at 23
            st = grids[k][3][r, a:b]  # wrapped to 0-2)
            entries = np.flatnonzero(st & ~np.roll(st, 1))
            first = int(entries[0]) if len(entries) else first
        out.append(_Run(_KINDS[k], r, a, b, first, least))
    return out


class _Mask:
    """A set of units as boolean arrays, shaped like the model's units."""

    def __init__(self, model: MarketModel, units: Set[Unit]) -> None:
        self.head = False
        self.layer = np.zeros(model.n_layer, dtype=bool)
        self.expert = np.zeros((model.n_layer, model.n_expert), dtype=bool)
        for u in units:
            if u.kind == "head":
                self.head = True
            elif u.kind == "layer":
                self.layer[u.layer] = True
            else:
                self.expert[u.layer, u.expert] = True


def _group(
    s: np.ndarray, free: np.ndarray, size: np.ndarray, stored: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Contiguous runs of equal positive scarcity among the ``free`` units, along each row
    of ``s``: (row, start, end, scarcity, largest and smallest unit's bytes, bytes stored),
    one entry per run."""
    ok = (s > 0) & free
    joined = np.zeros_like(ok)  # unit j continues the run of unit j - 1
    joined[:, 1:] = ok[:, 1:] & ok[:, :-1] & (s[:, 1:] == s[:, :-1])
    last = np.ones_like(ok)  # unit j ends its run
    last[:, :-1] = ~joined[:, 1:]
    rows, starts = np.nonzero(ok & ~joined)
    ends = np.nonzero(ok & last)[1] + 1
    if not len(rows):
        empty = np.zeros(0, dtype=np.int64)
        return rows, starts, ends, np.zeros(0), empty, empty, empty
    # reduce over [start, end) of each run: every other segment of the interleaved bounds
    bounds = np.column_stack([rows * s.shape[1] + starts, rows * s.shape[1] + ends]).ravel()

    def over_runs(f: np.ufunc, values: np.ndarray) -> np.ndarray:
        return f.reduceat(np.append(values.ravel(), 0), bounds)[::2]

    return (
        rows,
        starts,
        ends,
        s[rows, starts],
        over_runs(np.maximum, size),
        over_runs(np.minimum, size),
        over_runs(np.add, size * stored),
    )


def _surplus(
    model: MarketModel,
    counts: Counts,
    targets: Targets,
    me: str,
    held: set[Unit],
    holders: Callable[[Unit], list[str]],
) -> list[Unit]:
    """Units we hold beyond their target where we are a designated surplus holder.

    Ordered so that ``pop()`` yields the most over-covered first.
    """
    out: list[tuple[float, Unit]] = []
    for u in held:
        have, want = counts.of(u), _target(targets, u)
        if have <= want:
            continue
        ranked = sorted(holders(u), key=lambda p: _rank(u, p))
        if me in ranked[want:]:
            out.append((have / max(want, 1), u))
    out.sort()
    return [u for _, u in out]


def _target(t: Targets, u: Unit) -> int:
    if u.kind == "head":
        return t.head
    if u.kind == "layer":
        return int(t.layer[u.layer])
    return int(t.expert[u.layer, u.expert])


def _rank(u: Unit, peer: str) -> bytes:
    return hashlib.sha256(f"{u}|{peer}".encode()).digest()
