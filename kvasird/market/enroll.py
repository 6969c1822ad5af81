"""decide(): which units this node should hold, from the map it sees. Pure.

Scarcest first (and among equally scarce, the largest unit first): fill the budget with
units whose replicas are short of their target, taking contiguous runs (one range per
layer keeps records small and dispatch cheap), starting at a random offset so nodes
deciding at the same moment spread out.
Hysteresis: a node gives a unit up only to make room for a scarcer one, only where the
unit has more holders than its target, and only if it is one of the designated surplus
holders (the same deterministic choice on every node), so a unit is never left uncovered.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Set
from dataclasses import dataclass

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


def decide(model: MarketModel, counts: Counts, targets: Targets, me: str, budget: int,
           held: set[Unit], pinned: set[Unit], holders: Callable[[Unit], list[str]],
           rng: np.random.Generator, peers: int = 1,
           stored: Set[Unit] = frozenset()) -> Plan:
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
    spare = sum(model.size(u) for u in droppable)
    drop: list[Unit] = []
    for run in wanted:
        deficit = _target(targets, run[0]) - counts.of(run[0])
        may_swap = rng.random() < SWAP_EAGERNESS * deficit / max(peers, 1)
        for u in run:
            size = model.size(u)
            if used + size > budget and (not may_swap or used + size - spare > budget):
                continue
            while used + size > budget:
                victim = droppable.pop()
                drop.append(victim)
                used -= model.size(victim)
                spare -= model.size(victim)
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


def _scarce_runs(model: MarketModel, counts: Counts, targets: Targets, held: set[Unit],
                 rng: np.random.Generator, stored: Set[Unit] = frozenset()) -> list[list[Unit]]:
    """Runs of scarce units we don't hold, scarcest first, each rotated to a random start
    (to its first stored unit when it has one)."""
    s_layer, s_expert, s_head = scarcity(counts, targets)
    runs: list[tuple[float, int, float, list[Unit]]] = []
    if s_head > 0 and HEAD not in held:
        runs.append((s_head, model.size(HEAD), rng.random(), [HEAD]))
    for s, units in _group(s_layer, lambda i: Unit("layer", i), held):
        runs.append((s, max(model.size(u) for u in units), rng.random(), units))
    for layer in range(model.n_layer if model.n_expert else 0):
        for s, units in _group(s_expert[layer], lambda e, l=layer: Unit("expert", l, e), held):
            runs.append((s, max(model.size(u) for u in units), rng.random(), units))
    # Equally scarce: the largest unit first (first-fit decreasing). A node that filled its
    # budget with small layers first could leave no room anywhere for the head (30 of 42
    # MiB per node in the 3-node demo), and nodes only give up surplus: it stayed uncovered.
    # Before both: runs with more bytes already on our disk.
    def on_disk(units: list[Unit]) -> int:
        return sum(model.size(u) for u in units if u in stored)

    runs.sort(key=lambda r: (-r[0], -on_disk(r[3]), -r[1], r[2]))
    out = []
    for _, _, _, units in runs:
        k = int(rng.integers(len(units)))
        # enter at a stored segment's start (cyclically: a run taken at 23 wrapped to 0-2)
        k = next((i for i, u in enumerate(units) if u in stored
                  and units[i - 1] not in stored), k) if stored else k
        out.append(units[k:] + units[:k])
    return out


def _group(s: np.ndarray, unit: Callable[[int], Unit], held: set[Unit]) -> list[tuple[float, list[Unit]]]:
    """Contiguous runs of equal positive scarcity, skipping units already held."""
    out: list[tuple[float, list[Unit]]] = []
    current: list[Unit] = []
    level = 0.0
    for i, v in enumerate(s):
        u = unit(i)
        if v > 0 and u not in held and (not current or v == level):
            current.append(u)
            level = float(v)
            continue
        if current:
            out.append((level, current))
        current, level = ([u], float(v)) if v > 0 and u not in held else ([], 0.0)
    if current:
        out.append((level, current))
    return out


def _surplus(model: MarketModel, counts: Counts, targets: Targets, me: str, held: set[Unit],
             holders: Callable[[Unit], list[str]]) -> list[Unit]:
    """Units we hold beyond their target where we are a designated surplus holder.

    Ordered so that ``pop()`` yields the most over-covered first.
    """
    out: list[tuple[float, Unit]] = []
    for u in held:
        have, want = counts.of(u), _target(targets, u)
        if have <= want:
            continue
        ranked = sorted(holders(u), key=lambda p, u=u: _rank(u, p))
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
