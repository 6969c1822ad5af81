"""Receipts: the gateway's signed, cumulative statement of what it owes a peer.

One receipt per (gateway, peer, epoch), re-issued with a higher ``seq`` as work
accrues; amounts only grow. The peer keeps the latest valid one per gateway and epoch
(``ReceiptBook``), verifies payouts on chain (sent by the gateway, to its own token
account, each signature once), and stops serving a gateway whose unpaid total exceeds
its exposure limit.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from solders.pubkey import Pubkey
from solders.signature import Signature

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import PaymentRejected, ReceiptRejected, SignatureAlreadyUsed
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.token import token_account
from kvasird.settlement.verify import net_debit

_DOMAIN = b"kvasir-receipt-v1\n"


@dataclass(frozen=True)
class Receipt:
    """What gateway ``gateway`` measured and owes ``peer_id`` in ``epoch``, cumulatively."""

    network: str
    """Network name (a receipt is not valid on another network)."""
    gateway: Pubkey
    """The gateway's wallet, which signs and pays."""
    peer_id: str
    """The peer that did the work."""
    epoch: int
    """Accounting period."""
    units: int
    """Work units the gateway measured (before tiers), cumulative in the epoch: what the
    peer's own meter compares them with."""
    amount: int
    """KVR base units earned, cumulative in the epoch."""
    seq: int
    """Increases with every re-issue."""
    signature: Signature
    """The gateway wallet's signature over ``body()``."""

    def body(self) -> bytes:
        return receipt_body(
            self.network, self.gateway, self.peer_id, self.epoch, self.units, self.amount, self.seq
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "network": self.network,
            "gateway": str(self.gateway),
            "peer_id": self.peer_id,
            "epoch": self.epoch,
            "units": self.units,
            "amount": self.amount,
            "seq": self.seq,
            "signature": str(self.signature),
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Receipt:
        """Parse and verify the signature; an unsigned or forged receipt never leaves here."""
        try:
            receipt = cls(
                str(data["network"]),
                Pubkey.from_string(data["gateway"]),
                str(data["peer_id"]),
                int(data["epoch"]),
                int(data["units"]),
                int(data["amount"]),
                int(data["seq"]),
                Signature.from_string(data["signature"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ReceiptRejected(f"malformed receipt: {exc}") from None
        if not receipt.signature.verify(receipt.gateway, receipt.body()):
            raise ReceiptRejected(f"receipt is not signed by gateway {receipt.gateway}: ignored")
        return receipt


def receipt_body(
    network: str, gateway: Pubkey, peer_id: str, epoch: int, units: int, amount: int, seq: int
) -> bytes:
    return (
        _DOMAIN
        + json.dumps(
            {
                "network": network,
                "gateway": str(gateway),
                "peer_id": peer_id,
                "epoch": epoch,
                "units": units,
                "amount": amount,
                "seq": seq,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
    )


class ReceiptBook:
    """The peer's side: receipts it holds and payouts it has seen land."""

    def __init__(self, ledger: Ledger, peer_id: str, network: str) -> None:
        self._ledger = ledger
        self._peer_id = peer_id
        self._network = network

    def accept(self, wire: dict[str, Any]) -> Receipt:
        receipt = Receipt.from_wire(wire)
        if receipt.peer_id != self._peer_id or receipt.network != self._network:
            raise ReceiptRejected(
                f"receipt is for {receipt.peer_id} on {receipt.network}, not this node"
            )
        with self._ledger.transaction() as db:
            row = db.execute(
                "SELECT amount, seq FROM settlement_peer_receipts WHERE gateway = ? AND epoch = ?",
                (str(receipt.gateway), receipt.epoch),
            ).fetchone()
            if row is not None and (receipt.seq <= row[1] or receipt.amount < row[0]):
                raise ReceiptRejected(
                    f"receipt seq {receipt.seq} from {receipt.gateway} is not newer "
                    "than the one held, or lowers the amount: ignored"
                )
            db.execute(
                "INSERT OR REPLACE INTO settlement_peer_receipts VALUES (?, ?, ?, ?, ?)",
                (
                    str(receipt.gateway),
                    receipt.epoch,
                    receipt.amount,
                    receipt.seq,
                    json.dumps(receipt.to_wire()),
                ),
            )
        return receipt

    def held(self, gateway: Pubkey, epoch: int) -> tuple[int, int]:
        """(units, amount) of the receipt held from ``gateway`` for ``epoch`` ((0, 0): none)."""
        row = self._ledger.one(
            "SELECT amount, body FROM settlement_peer_receipts WHERE gateway = ? AND epoch = ?",
            str(gateway),
            epoch,
        )
        return (int(json.loads(row[1])["units"]), int(row[0])) if row else (0, 0)

    def unpaid(self, gateway: Pubkey) -> int:
        """Receipts from ``gateway`` not yet matched by payouts verified on chain."""
        return max(self.earned(gateway) - self.received(gateway), 0)

    def remember_gateway(self, gateway: Pubkey, peer_id: str) -> None:
        """The peer id the gateway wallet's receipts come from: where claims go."""
        with self._ledger.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO settlement_peer_gateways VALUES (?, ?)",
                (str(gateway), peer_id),
            )

    def gateways(self) -> list[tuple[Pubkey, str, int]]:
        """(gateway wallet, its peer id, unpaid) for every gateway this node holds receipts of."""
        rows = self._ledger.db.execute(
            "SELECT DISTINCT r.gateway, g.peer_id FROM settlement_peer_receipts r "
            "JOIN settlement_peer_gateways g ON g.gateway = r.gateway ORDER BY r.gateway"
        ).fetchall()
        return [(Pubkey.from_string(w), p, self.unpaid(Pubkey.from_string(w))) for w, p in rows]

    def received(self, gateway: Pubkey) -> int:
        """Every payout from ``gateway`` the chain has shown this node."""
        return self._ledger.value(
            "SELECT SUM(amount) FROM settlement_peer_payouts WHERE gateway = ?", str(gateway)
        )

    def earned(self, gateway: Pubkey) -> int:
        """What ``gateway``'s latest receipts say it owes this node in all, paid or not."""
        return self._ledger.value(
            "SELECT SUM(amount) FROM settlement_peer_receipts WHERE gateway = ?", str(gateway)
        )

    async def verify_payout(
        self,
        chain: ChainClient,
        gateway: Pubkey,
        wallet: Pubkey,
        mint: Pubkey,
        signature: Signature,
    ) -> int:
        """Count a payout only if the chain shows ``gateway`` paid KVR into ``wallet``'s account."""
        tx = await chain.transaction(signature)
        if tx is None or tx.error is not None:
            raise PaymentRejected(
                f"payout {signature} is unknown or failed on chain: claim again later"
            )
        mine = token_account(wallet, mint)
        received = sum(d.change for d in tx.token_deltas if d.account == mine and d.mint == mint)
        if received <= 0 or net_debit(tx, gateway, mint) < received:
            raise PaymentRejected(
                f"transaction {signature} is not a payout from {gateway} to {wallet}"
            )
        try:
            with self._ledger.transaction() as db:
                db.execute(
                    "INSERT INTO settlement_peer_payouts VALUES (?, ?, ?)",
                    (str(signature), str(gateway), received),
                )
        except sqlite3.IntegrityError:
            raise SignatureAlreadyUsed(f"payout {signature} was already counted") from None
        return received
