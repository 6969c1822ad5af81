"""How often a node takes part in an enrollment round, and how much it takes: the herd
guard. Pure.

Every node deciding within one propagation window sees the same scarce units and takes
them: at 10,000 nodes, every one of them polling every ``rebalance_s``, a few replicas
lost to churn drew hundreds of nodes (the simulation: half of all nodes ended up holding
something, and every one of them pays keep-alives and churn). So a node joins a round
only with probability

    p = max(1, missing_bytes / take) * rebalance_s / (participants * heartbeat_s)

(capped at 1): across the network, about as many bytes enroll per heartbeat as replicas'
bytes are missing, and never fewer than one node (a deficit smaller than one node's
take is filled within a heartbeat or so, not starved). ``take`` is what one node may add
in a round (``take_bytes``): what it downloads in TAKE_S at its own measured rate
(``Bandwidth``), at least its largest unit and at most its budget. A fixed take (512 MB
once) kept the slow tail downloading long after the median node (bench/sim_market.py), and
the slow node's units were the last back after churn; sized by the rate, every node's take
is back within about TAKE_S, and the fast ones take more of the deficit. Missing bytes and
participants are in every node's map. With a large deficit (a model just announced) p
is 1; and below HERD_MIN participants it is 1 too: there the few nodes deciding within
one propagation window (N x 0.5 s / 15 s < 2) make no herd, and the market behaves as it
always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvasird.market.coverage import Counts
from kvasird.market.demand import Targets
from kvasird.market.model import MarketModel

HERD_MIN = 50
TAKE_S = 30.0
"""Seconds of download one round's take is sized to, at the node's measured rate."""
DEFAULT_RATE = 16 * 10**6
"""Bytes/s assumed before the first download is measured (128 Mbit/s: a 480 MB take)."""
RATE_WEIGHT = 0.5
"""Weight of each new download in the rate's moving average."""
MIN_SAMPLE_S = 1.0
"""Downloads shorter than this are not measured: their time is mostly round trips."""


@dataclass
class Bandwidth:
    """This node's shard download rate: a moving average over its downloads."""

    rate: float = DEFAULT_RATE
    """Bytes/s (DEFAULT_RATE until a download was measured)."""
    measured: int = 0
    """Downloads measured so far."""

    def observe(self, received_bytes: int, seconds: float) -> None:
        """A download of ``received_bytes`` took ``seconds``; the first one measured
        replaces the default, later ones move the average by RATE_WEIGHT."""
        if received_bytes <= 0 or seconds < MIN_SAMPLE_S:
            return
        sample = received_bytes / seconds
        weight = 1.0 if not self.measured else RATE_WEIGHT
        self.rate += weight * (sample - self.rate)
        self.measured += 1


def _largest_unit(model: MarketModel) -> int:
    return max(
        model.head_bytes,
        int(model.layer_bytes.max(initial=0)),
        int(model.expert_bytes.max(initial=0)),
    )


def take_bytes(model: MarketModel, budget: int, rate: float) -> int:
    """What one node adds in a round: TAKE_S at ``rate`` (bytes/s), at least the model's
    largest unit (or no unit would ever fit), at most ``budget``."""
    return min(budget, max(int(TAKE_S * rate), _largest_unit(model)))


def missing_bytes(model: MarketModel, counts: Counts, targets: Targets) -> int:
    """Bytes of the replicas short of their targets."""
    out = max(0, targets.head - counts.head) * model.head_bytes
    out += int((np.clip(targets.layer - counts.layer, 0, None) * model.layer_bytes).sum())
    return out + int((np.clip(targets.expert - counts.expert, 0, None) * model.expert_bytes).sum())


def round_budget(model: MarketModel, budget: int, held_bytes: int, rate: float) -> int:
    """The budget this round's decision fills: what is held, plus at most one take."""
    return min(budget, held_bytes + take_bytes(model, budget, rate))


def joins_round(
    model: MarketModel,
    counts: Counts,
    targets: Targets,
    participants: int,
    budget: int,
    rate: float,
    rebalance_s: float,
    heartbeat_s: float,
    rng: np.random.Generator,
) -> bool:
    """Whether this node decides in this round (see the module docstring)."""
    need = missing_bytes(model, counts, targets)
    take = take_bytes(model, budget, rate)  # added, or swapped in for surplus
    if need == 0 or take <= 0:
        return False
    if participants < HERD_MIN:
        return True
    p = max(1.0, need / take) * rebalance_s / (max(participants, 1) * heartbeat_s)
    return p >= 1 or bool(rng.random() < p)
