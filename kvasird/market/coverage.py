"""CoverageMap: who holds which unit of a model, in which state, until when. Pure.

Replica counts are kept incrementally in arrays (one per unit kind), so a map of
10,000 peers over a 49 x 256-expert model updates cheaply per record (bench/sim_market.py
reports the time to apply one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvasird.errors import WireError
from kvasird.market.model import MarketModel
from kvasird.market.records import ACTIVE_STATES, CoverageRecord, Holding
from kvasird.model.manifest import Unit


@dataclass
class Counts:
    """Replica counts per unit: [n_layer], [n_layer, n_expert] and the head."""

    layer: np.ndarray
    expert: np.ndarray
    head: int = 0

    @classmethod
    def zeros(cls, model: MarketModel) -> Counts:
        return cls(
            np.zeros(model.n_layer, dtype=np.int32),
            np.zeros((model.n_layer, model.n_expert), dtype=np.int32),
        )

    def add(self, h: Holding, sign: int) -> None:
        if h.kind == "H":
            self.head += sign
        elif h.kind == "L":
            self.layer[h.lo : h.hi] += sign
        else:
            self.expert[h.start, h.lo : h.hi] += sign

    def of(self, unit: Unit) -> int:
        if unit.kind == "head":
            return self.head
        if unit.kind == "layer":
            return int(self.layer[unit.layer])
        return int(self.expert[unit.layer, unit.expert])


@dataclass(frozen=True)
class Entry:
    record: CoverageRecord
    """The newest record from this peer."""
    expires: float
    """Local time after which the record no longer counts."""


class CoverageMap:
    """The live holders of one model's units, from validated records."""

    def __init__(self, model: MarketModel) -> None:
        self.model = model
        self.entries: dict[str, Entry] = {}
        self.active = Counts.zeros(model)
        """Holders in joining/loading/online: what scarcity counts."""
        self.online = Counts.zeros(model)
        """Holders that can serve now: what routing uses."""

    def check(self, record: CoverageRecord) -> None:
        """Refuse holdings outside this model or beyond the node's own budget."""
        total = 0
        for h in record.holdings:
            last = (
                Unit("layer", h.hi - 1)
                if h.kind == "L"
                else (Unit("expert", h.start, h.hi - 1) if h.kind == "E" else Unit("head"))
            )
            if not self.model.contains(last):
                raise WireError(
                    f"holding {h.to_wire()} is outside model {record.model[:12]} "
                    f"({self.model.n_layer} layers x {self.model.n_expert} experts)"
                )
            total += self._bytes(h)
        if total > record.budget:
            raise WireError(f"claims {total} bytes of holdings with a budget of {record.budget}")

    def _bytes(self, h: Holding) -> int:
        if h.kind == "H":
            return self.model.head_bytes
        if h.kind == "L":
            return int(self.model.layer_bytes[h.lo : h.hi].sum())
        return int(self.model.expert_bytes[h.start, h.lo : h.hi].sum())

    def apply(self, record: CoverageRecord, now: float) -> bool:
        """Merge a record (newer sequence wins); return whether it changed the map."""
        old = self.entries.get(record.peer)
        if old is not None and old.record.seq >= record.seq:
            return False
        if record.model and record.model != self.model.model_id:
            return False
        self._count(old.record if old else None, -1)
        if record.state == "offline":
            self.entries.pop(record.peer, None)
            return True
        self.entries[record.peer] = Entry(record, now + record.ttl)
        self._count(record, +1)
        return True

    def _count(self, record: CoverageRecord | None, sign: int) -> None:
        if record is None:
            return
        for h in record.holdings:
            if h.state in ACTIVE_STATES:
                self.active.add(h, sign)
            if h.state == "online":
                self.online.add(h, sign)

    def suspect(self, peer: str, seq: int, until: float) -> bool:
        """A peer saw ``peer`` fail while its record was at ``seq``: unless a newer record came
        meanwhile, the record now expires at ``until`` (sooner, never later); a newer
        record from it, the refutation, restores its full TTL."""
        entry = self.entries.get(peer)
        if entry is None or entry.record.seq > seq or entry.expires <= until:
            return False
        self.entries[peer] = Entry(entry.record, until)
        return True

    def remove(self, peer: str) -> None:
        """Take a peer out (caught lying): its holdings no longer count."""
        entry = self.entries.pop(peer, None)
        if entry is not None:
            self._count(entry.record, -1)

    def expire(self, now: float) -> list[str]:
        """Remove peers whose last record outlived its TTL; return their ids."""
        gone = [p for p, e in self.entries.items() if e.expires < now]
        for peer in gone:
            self._count(self.entries.pop(peer).record, -1)
        return gone

    def holders(self, unit: Unit, states: frozenset[str] = ACTIVE_STATES) -> list[str]:
        out = []
        for peer, e in self.entries.items():
            for h in e.record.holdings:
                if h.state in states and _covers(h, unit):
                    out.append(peer)
                    break
        return out


def _covers(h: Holding, unit: Unit) -> bool:
    if unit.kind == "head":
        return h.kind == "H"
    if unit.kind == "layer":
        return h.kind == "L" and h.lo <= unit.layer < h.hi
    return h.kind == "E" and h.start == unit.layer and h.lo <= unit.expert < h.hi
