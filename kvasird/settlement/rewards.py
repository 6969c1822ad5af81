"""Rewards from the gateway's own measurements, and the revenue split.

The gateway counts each peer's units (tokens served × layers for a stage, rows ×
experts for a worker) and times the peer itself; the tier comes from those timings.
There is no parameter through which a peer's own claims (units, role, tier) could
enter: ``MeasuredWork`` is built by the gateway only. Each paid request is settled
once: workers' share by weighted units, the operator's fee (plus rounding), and the
insurance pool; every peer's cumulative receipt for the epoch grows in the same
SQLite transaction.

A peer's share of one request is often less than a base unit (a spot check's replay, a
layer or two of a long route: a request costs a few dozen base units at genesis prices).
Floored per request it would be nothing, forever, and the operator would keep it; so what
the floor leaves of each share is carried (in millionths of a base unit, per peer) to the
peer's next request, and a peer is paid its share of the work to the base unit over time.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from solders.keypair import Keypair

from kvasird.settlement.config import RevenueSplit, TierThresholds
from kvasird.settlement.errors import QuoteError, ReceiptRejected
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.receipts import Receipt, receipt_body

TIER_PERCENT = {"S": 150, "A": 125, "B": 100, "C": 70}
"""Reward multiplier per performance tier, in percent."""
FRACTION = 10**6
"""What a base unit is split into for the shares carried from one request to the next."""
_SCHEMA = """
CREATE TABLE IF NOT EXISTS settlement_carried (
    peer_id TEXT PRIMARY KEY, fraction INTEGER NOT NULL);
"""


def tier_for(ms_per_token: float, thresholds: TierThresholds) -> str:
    """The tier a peer earns from latency the gateway measured itself."""
    for tier, limit in (("S", thresholds.s_ms), ("A", thresholds.a_ms), ("B", thresholds.b_ms)):
        if ms_per_token <= limit:
            return tier
    return "C"


@dataclass(frozen=True)
class MeasuredWork:
    """Work the gateway observed one peer do for one request."""

    peer_id: str
    """The peer (authenticated by its libp2p connection, not by anything it said)."""
    units: int
    """Units counted by the gateway: ``stage_units`` or ``worker_units``."""
    ms_per_token: float
    """The peer's per-token latency as the gateway timed it."""

    @staticmethod
    def stage_units(tokens: int, layers: int) -> int:
        return tokens * layers

    @staticmethod
    def worker_units(rows: int, experts: int) -> int:
        return rows * experts


@dataclass(frozen=True)
class SplitResult:
    """How one paid request was divided."""

    workers: dict[str, int]
    """Peer id → base units earned."""
    operator: int
    """Gateway operator's fee, including rounding remainders."""
    insurance: int
    """Into the insurance pool."""
    carried: dict[str, int]
    """Peer id → what its share left below a base unit, in FRACTIONs of one, for its next
    request."""


def split_revenue(
    amount: int,
    work: Sequence[MeasuredWork],
    split: RevenueSplit,
    tiers: TierThresholds,
    carried: Mapping[str, int] | None = None,
) -> SplitResult:
    """Split ``amount``: the workers' pool by weighted units, each worker's share added to
    what it ``carried`` from earlier requests and paid in whole base units (never more than
    the request leaves after insurance); the operator gets the rest."""
    insurance = amount * split.insurance_bps // 10_000
    pool = amount * split.workers_bps // 10_000
    weights: dict[str, int] = {}
    for w in work:
        if w.units < 0:
            raise ValueError("measured units cannot be negative")
        weights[w.peer_id] = (
            weights.get(w.peer_id, 0) + w.units * TIER_PERCENT[tier_for(w.ms_per_token, tiers)]
        )
    total = sum(weights.values())
    room = amount - insurance
    workers, carry = {}, {}
    for p, wt in weights.items():
        owed = (carried or {}).get(p, 0) + pool * wt * FRACTION // total
        workers[p] = min(owed // FRACTION, room)
        carry[p] = owed - workers[p] * FRACTION
        room -= workers[p]
    return SplitResult(workers, room, insurance, carry)


@dataclass(frozen=True)
class PeerEarnings:
    """One peer's account at this gateway."""

    peer_id: str
    """The peer that worked for this gateway."""
    earned: int
    """Base units it earned, over every request."""
    paid: int
    """Base units paid out to it (confirmed claims)."""
    measured_units: int
    """The work this gateway measured it do (units before tiers)."""

    def to_json(self) -> dict[str, str | int]:
        return {
            "peer_id": self.peer_id,
            "earned": self.earned,
            "paid": self.paid,
            "measured_units": self.measured_units,
        }


class Rewards:
    """The gateway's side: settle paid requests into earnings, issue receipts."""

    def __init__(
        self,
        ledger: Ledger,
        gateway: Keypair,
        network: str,
        split: RevenueSplit,
        tiers: TierThresholds,
    ) -> None:
        self._ledger = ledger
        self._gateway = gateway
        self._network = network
        self._split = split
        self._tiers = tiers
        ledger.db.executescript(_SCHEMA)

    def settle(
        self,
        request_id: str,
        work: Sequence[MeasuredWork],
        epoch: int,
        served: int | None = None,
        used: int | None = None,
    ) -> SplitResult:
        """Divide a paid request's amount; each request is settled (or failed) once.

        ``served``: of a request cut short by a failure, the part of the amount that was
        served (split by the work as usual); the rest moves to the insurance pool and is
        owed back to the payer (``Payouts.refund``), and the request counts as failed.
        ``used``: of a request that ended well, what its tokens cost at the quote's prices;
        the rest (a shorter answer than paid for) is credited to the payer's prepaid balance.
        """
        with self._ledger.transaction() as db:
            row = db.execute(
                "SELECT amount, payer FROM settlement_quotes WHERE request_id = ? AND "
                "state = 'paid'",
                (request_id,),
            ).fetchone()
            if row is None:
                raise QuoteError("request is not paid, or was already settled or refunded")
            unused = (
                min(max(row[0] - used, 0), row[0]) if used is not None and served is None else 0
            )
            if unused and row[1] and row[1] != str(self._gateway.pubkey()):  # not our own use
                db.execute(
                    "INSERT INTO settlement_deposits VALUES (?, ?) ON CONFLICT (owner) "
                    "DO UPDATE SET balance = balance + excluded.balance",
                    (row[1], unused),
                )
            paid = row[0] - unused
            amount = paid if served is None else min(max(served, 0), paid)
            peers = sorted({w.peer_id for w in work})
            carried = dict(
                db.execute(
                    "SELECT peer_id, fraction FROM settlement_carried WHERE peer_id IN "
                    f"({','.join('?' * len(peers))})",
                    peers,
                ).fetchall()
            )
            result = split_revenue(amount, work, self._split, self._tiers, carried)
            db.executemany(
                "INSERT OR REPLACE INTO settlement_carried VALUES (?, ?)", result.carried.items()
            )
            db.execute(
                "UPDATE settlement_quotes SET state = ?, charged = ? WHERE request_id = ?",
                ("settled" if amount == paid else "failed", amount, request_id),
            )
            if amount < paid:
                db.execute(
                    "INSERT INTO settlement_refunds VALUES (?, ?)", (request_id, paid - amount)
                )
                _add_to_pool(db, "insurance", paid - amount)
            for w in work:
                tier = tier_for(w.ms_per_token, self._tiers)
                db.execute(
                    "INSERT INTO settlement_work VALUES (?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET "
                    "units = units + excluded.units",
                    (request_id, w.peer_id, w.units, tier, result.workers.get(w.peer_id, 0)),
                )
            for peer, amount in result.workers.items():
                units = sum(w.units for w in work if w.peer_id == peer)
                db.execute(
                    "INSERT INTO settlement_earnings (peer_id, earned) VALUES (?, ?) ON CONFLICT "
                    "DO UPDATE SET earned = earned + excluded.earned",
                    (peer, amount),
                )
                db.execute(
                    "INSERT INTO settlement_receipts VALUES (?, ?, ?, ?, 1) ON CONFLICT DO UPDATE "
                    "SET units = units + excluded.units, amount = amount + excluded.amount, "
                    "seq = seq + 1",
                    (peer, epoch, units, amount),
                )
            for pool, amount in (("operator", result.operator), ("insurance", result.insurance)):
                _add_to_pool(db, pool, amount)
        return result

    def fail(self, request_id: str) -> None:
        """A paid request that could not be served at all: its whole amount moves to the
        insurance pool, from which ``Payouts.refund`` pays the consumer back."""
        self.settle(request_id, (), 0, served=0)

    def receipt(self, peer_id: str, epoch: int) -> Receipt:
        row = self._ledger.one(
            "SELECT units, amount, seq FROM settlement_receipts WHERE peer_id = ? AND epoch = ?",
            peer_id,
            epoch,
        )
        if row is None:
            raise ReceiptRejected(f"no work recorded for {peer_id} in epoch {epoch}")
        units, amount, seq = row
        gateway = self._gateway.pubkey()
        body = receipt_body(self._network, gateway, peer_id, epoch, units, amount, seq)
        return Receipt(
            self._network,
            gateway,
            peer_id,
            epoch,
            units,
            amount,
            seq,
            self._gateway.sign_message(body),
        )

    def earned(self, peer_id: str) -> int:
        return self._ledger.value(
            "SELECT earned FROM settlement_earnings WHERE peer_id = ?", peer_id
        )

    def own_use(self) -> tuple[int, int]:
        """(requests, base units charged) of the operator's own requests, paid by the vault."""
        row = self._ledger.one(
            "SELECT COUNT(*), SUM(charged) FROM settlement_quotes WHERE "
            "payer = ? AND state != 'paid'",
            str(self._gateway.pubkey()),
        )
        return (int(row[0]), int(row[1] or 0)) if row else (0, 0)

    def pool(self, name: str) -> int:
        return self._ledger.value("SELECT balance FROM settlement_pools WHERE name = ?", name)

    def peers(self) -> list[PeerEarnings]:
        """What this gateway owes each peer that worked for it, by peer id."""
        rows = self._ledger.db.execute(
            "SELECT peer_id, earned, paid FROM settlement_earnings ORDER BY peer_id"
        ).fetchall()
        units = dict(
            self._ledger.db.execute(
                "SELECT peer_id, SUM(units) FROM settlement_work GROUP BY peer_id"
            ).fetchall()
        )
        return [PeerEarnings(p, earned, paid, units.get(p, 0)) for p, earned, paid in rows]


def _add_to_pool(db: sqlite3.Connection, name: str, amount: int) -> None:
    db.execute(
        "INSERT INTO settlement_pools VALUES (?, ?) ON CONFLICT DO UPDATE SET "
        "balance = balance + excluded.balance",
        (name, amount),
    )
