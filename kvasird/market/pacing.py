"""How often a node takes part in an enrollment round: the herd guard. Pure.

Every node deciding within one propagation window sees the same scarce units and takes
them: at 10,000 nodes, every one of them polling every ``rebalance_s``, a few replicas
lost to churn drew hundreds of nodes (the simulation: half of all nodes ended up holding
something, and every one of them pays keep-alives and churn). So a node joins a round
only with probability

    p = max(1, missing_bytes / take) * rebalance_s / (participants * heartbeat_s)

(capped at 1): across the network, about as many bytes enroll per heartbeat as replicas'
bytes are missing, and never fewer than one node (a deficit smaller than one node's
take is filled within a heartbeat or so, not starved). ``take`` is what one node may add
in a round: ROUND_BYTES (or the largest unit; its budget if less), so that what a
holder lost to churn is re-covered by several nodes downloading in parallel, each within
seconds, instead of by one node downloading gigabytes for minutes. Both numbers are in every node's map. With a large
deficit (a model just announced) p is 1; and below HERD_MIN participants it is 1 too:
there the few nodes deciding within one propagation window (N x 0.5 s / 15 s < 2) make
no herd, and the market behaves as it always did.
"""

from __future__ import annotations

import numpy as np

from kvasird.market.coverage import Counts
from kvasird.market.demand import Targets
from kvasird.market.model import MarketModel

HERD_MIN = 50
ROUND_BYTES = 512 * 10**6
"""The most one node adds in a round (beyond its largest unit): 20 s at 25 MB/s."""


def missing_bytes(model: MarketModel, counts: Counts, targets: Targets) -> int:
    """Bytes of the replicas short of their targets."""
    out = max(0, targets.head - counts.head) * model.head_bytes
    out += int((np.clip(targets.layer - counts.layer, 0, None) * model.layer_bytes).sum())
    return out + int((np.clip(targets.expert - counts.expert, 0, None) * model.expert_bytes).sum())


def round_budget(model: MarketModel, budget: int, held_bytes: int) -> int:
    """The budget this round's decision fills: what is held, plus at most one take."""
    largest = max(model.head_bytes, int(model.layer_bytes.max(initial=0)),
                  int(model.expert_bytes.max(initial=0)))
    return min(budget, held_bytes + max(ROUND_BYTES, largest))


def joins_round(model: MarketModel, counts: Counts, targets: Targets, participants: int,
                budget: int, rebalance_s: float, heartbeat_s: float,
                rng: np.random.Generator) -> bool:
    """Whether this node decides in this round (see the module docstring)."""
    need = missing_bytes(model, counts, targets)
    take = round_budget(model, budget, 0)  # added, or swapped in for surplus
    if need == 0 or take <= 0:
        return False
    if participants < HERD_MIN:
        return True
    p = max(1.0, need / take) * rebalance_s / (max(participants, 1) * heartbeat_s)
    return p >= 1 or bool(rng.random() < p)
