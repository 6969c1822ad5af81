"""Targets from observed load, scarcity per unit, and scarce segments. Pure.

Target replicas start at the network's ``target_replicas`` for every unit. Stages gossip
how often each expert was selected; an expert selected k >= 1.25 times the layer's mean
gets ``round(base * k)`` replicas (capped at ``base * max_factor``), so hot experts attract
more holders than cold ones, and near-average ones keep the base target. Scarcity of a unit
is ``max(0, target - replicas) / target``.

A market with room to spare holds one replica more of every unit than its targets ask
(``with_spare``): a holder lost to churn then leaves its units at their target while a
replacement downloads, instead of short of it for the 20 to 60 s that detection and the
download take. Only enrollment (``decide``, the herd guard) uses the spare targets;
what a node reports as covered is measured against the targets themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvasird.market.coverage import Counts
from kvasird.market.model import MarketModel
from kvasird.market.records import LoadReport

HALF_LIFE_S = 600.0
MAX_FACTOR = 3.0
HOT_RATIO = 1.25
"""Selections relative to the layer's mean above which an expert counts as hot."""
SPARE_ROOM = 4
"""The spare replica is held only where the market's budget left over by the targets is
at least this many spare replicas' bytes: the budgets are an estimate (how far off at
10,000 nodes: bench/sim_market.py), fragmented over nodes, and some of them hold other
models."""


@dataclass
class Targets:
    layer: np.ndarray
    """Target replicas per layer's dense path, [n_layer]."""
    expert: np.ndarray
    """Target replicas per expert, [n_layer, n_expert]."""
    head: int
    """Target replicas of the head."""


class Demand:
    """Exponentially decayed expert-selection counts from stages' load reports."""

    def __init__(self, model: MarketModel, half_life_s: float = HALF_LIFE_S) -> None:
        self.model = model
        self.half_life_s = half_life_s
        self.selections = np.zeros((model.n_layer, model.n_expert), dtype=np.float64)
        self._at = 0.0

    def _decay_to(self, now: float) -> None:
        if self._at:
            self.selections *= 0.5 ** (max(0.0, now - self._at) / self.half_life_s)
        self._at = now

    def add(self, report: LoadReport, now: float) -> None:
        self._decay_to(now)
        for layer, expert, count in report.experts:
            if layer < self.model.n_layer and expert < self.model.n_expert:
                self.selections[layer, expert] += count

    def targets(self, base: int, max_factor: float = MAX_FACTOR) -> Targets:
        expert = np.full((self.model.n_layer, self.model.n_expert), base, dtype=np.int32)
        if self.model.n_expert:
            mean = self.selections.mean(axis=1, keepdims=True)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(mean > 0, self.selections / mean, 1.0)
            # Only clearly hot experts earn extra replicas: an expert a few percent above its
            # layer's mean under uniform load must not (the simulator showed half of all
            # experts flipping to base+1, doubling storage and gossip).
            factor = np.where(ratio >= HOT_RATIO, np.clip(ratio, 1.0, max_factor), 1.0)
            expert = np.floor(base * factor + 0.5).astype(np.int32)
        return Targets(np.full(self.model.n_layer, base, dtype=np.int32), expert, base)


def wanted_bytes(model: MarketModel, targets: Targets) -> int:
    """Bytes of all the replicas ``targets`` ask for."""
    return (
        targets.head * model.head_bytes
        + int((targets.layer * model.layer_bytes).sum())
        + int((targets.expert * model.expert_bytes).sum())
    )


def with_spare(targets: Targets, model: MarketModel, market_budget: int) -> Targets:
    """``targets`` plus one replica of every unit when ``market_budget`` (bytes all nodes
    offer, ``publish.market_budget``) has room for SPARE_ROOM such replicas beyond what
    ``targets`` want; else ``targets`` unchanged."""
    spare = Targets(targets.layer + 1, targets.expert + 1, targets.head + 1)
    room = market_budget - wanted_bytes(model, targets)
    extra = wanted_bytes(model, spare) - wanted_bytes(model, targets)
    return spare if room >= SPARE_ROOM * extra else targets


def scarcity(counts: Counts, targets: Targets) -> tuple[np.ndarray, np.ndarray, float]:
    """(layer, expert, head) scarcity in [0, 1]: the missing fraction of each target."""

    def s(c: np.ndarray, t: np.ndarray) -> np.ndarray:
        return np.clip(t - c, 0, None) / np.maximum(t, 1)

    head = max(0, targets.head - counts.head) / max(targets.head, 1)
    return s(counts.layer, targets.layer), s(counts.expert, targets.expert), head


def segments(model: MarketModel, counts: Counts, targets: Targets) -> list[dict[str, Any]]:
    """Contiguous runs of units with equal replicas and target, like the seeds' expert-demand.

    ``{"unit": "experts", "layer": 0, "experts": [128, 192], "replicas": 1, "target": 2,
    "scarcity": 0.5}``; layers merge into ``{"unit": "layers", "layers": [a, b], ...}``.
    """
    out: list[dict[str, Any]] = [
        {
            "unit": "head",
            "replicas": counts.head,
            "target": targets.head,
            "scarcity": round(max(0, targets.head - counts.head) / max(targets.head, 1), 4),
        }
    ]
    for a, b, r, t in _runs(counts.layer, targets.layer):
        out.append(
            {"unit": "layers", "layers": [a, b], "replicas": r, "target": t, "scarcity": _s(r, t)}
        )
    for layer in range(model.n_layer if model.n_expert else 0):
        for a, b, r, t in _runs(counts.expert[layer], targets.expert[layer]):
            out.append(
                {
                    "unit": "experts",
                    "layer": layer,
                    "experts": [a, b],
                    "replicas": r,
                    "target": t,
                    "scarcity": _s(r, t),
                }
            )
    return out


def _s(r: int, t: int) -> float:
    return round(max(0, t - r) / max(t, 1), 4)


def _runs(c: np.ndarray, t: np.ndarray) -> list[tuple[int, int, int, int]]:
    out: list[tuple[int, int, int, int]] = []
    start = 0
    for i in range(1, len(c) + 1):
        if i == len(c) or c[i] != c[start] or t[i] != t[start]:
            out.append((start, i, int(c[start]), int(t[start])))
            start = i
    return out


def fully_covered(counts: Counts, targets: Targets) -> bool:
    return (
        counts.head >= targets.head
        and bool((counts.layer >= targets.layer).all())
        and bool((counts.expert >= targets.expert).all())
    )
