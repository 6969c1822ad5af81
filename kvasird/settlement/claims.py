"""Claims and refunds: pay out on chain first, then debit — recoverably.

Every payout follows one path, under the lock of the balance it draws on:

    prepare   sign the transfer (its signature is now known) and record it as
              'pending' under that signature; a pending payout reserves its amount
    submit    send it and wait for the required commitment
    finish    in one SQLite transaction: mark it 'done' (only from 'pending') and debit
              — or mark it 'failed', leaving the balance intact

If the process dies anywhere in between, ``reconcile`` (run at start-up) asks the chain
about each pending signature, resends the stored transaction if the chain has not seen
it (same bytes, same signature: it cannot land twice), and finishes it. A payout whose
blockhash expired without landing can never land, so it fails safely.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import Transaction

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import ChainError, ChainRefused, ClaimError, WalletError
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.token import transfer_instructions
from kvasird.settlement.wallet import WalletLink


@dataclass(frozen=True)
class Payout:
    """A payout transaction and where it stands."""

    signature: str
    """The payout transaction's signature (its key in the ledger)."""
    kind: str
    """'claim' (peer earnings) or 'refund' (insurance pool to a consumer)."""
    key: str
    """Peer id for claims, request id for refunds."""
    recipient: str
    """Wallet paid."""
    amount: int
    """Base units."""
    state: str
    """'pending', 'done' or 'failed'."""


class Payouts:
    def __init__(
        self,
        ledger: Ledger,
        chain: ChainClient,
        vault: Keypair,
        mint: Pubkey,
        locks: KeyedLocks,
        confirm_timeout_s: float = 60.0,
    ) -> None:
        self._ledger = ledger
        self._chain = chain
        self._vault = vault
        self._mint = mint
        self._locks = locks
        self._timeout = confirm_timeout_s

    def claimable(self, peer_id: str, db: sqlite3.Connection | None = None) -> int:
        """Earned − paid − reserved by pending payouts."""
        row = (
            (db or self._ledger.db)
            .execute(
                "SELECT COALESCE((SELECT earned - paid FROM settlement_earnings"
                " WHERE peer_id = ?1), 0)"
                " - COALESCE((SELECT SUM(amount) FROM settlement_payouts"
                " WHERE kind = 'claim' AND key = ?1 "
                "AND state = 'pending'), 0)",
                (peer_id,),
            )
            .fetchone()
        )
        return int(row[0] or 0)

    async def claim(self, peer_id: str, wallet: Pubkey) -> Payout:
        """Pay ``peer_id`` all it can claim, to ``wallet`` (from its verified wallet link)."""
        async with self._locks.hold(f"peer:{peer_id}"):
            amount = self.claimable(peer_id)
            if amount <= 0:
                raise ClaimError(f"nothing to claim for {peer_id}: no unpaid earnings")
            payout = await self.prepare(
                "claim", peer_id, wallet, amount, lambda db: self.claimable(peer_id, db)
            )
            return await self.submit(payout)

    async def refund(self, request_id: str) -> Payout:
        """Refund the unserved part of a failed request (``Rewards.settle`` with ``served``)
        from the insurance pool to its payer."""
        async with self._locks.hold("pool:insurance"):
            row = self._ledger.one(
                "SELECT r.amount, q.payer FROM settlement_quotes q JOIN settlement_refunds r "
                "ON r.request_id = q.request_id WHERE q.request_id = ? AND q.state = 'failed'",
                request_id,
            )
            if row is None or not row[1]:
                raise ClaimError("request is not a failed paid request: nothing to refund")
            if self._ledger.one(
                "SELECT 1 FROM settlement_payouts WHERE kind = 'refund' AND key = ? "
                "AND state != 'failed'",
                request_id,
            ):
                raise ClaimError("request was already refunded")
            payout = await self.prepare(
                "refund", request_id, Pubkey.from_string(row[1]), row[0], _insurance_available
            )
            return await self.submit(payout)

    async def prepare(
        self,
        kind: str,
        key: str,
        recipient: Pubkey,
        amount: int,
        available: Callable[[sqlite3.Connection], int],
    ) -> Payout:
        """Sign the transfer and record it as pending; nothing is sent yet. Call under the lock.

        What the balance holds is read again in the transaction that reserves the amount
        (``available``), so a second process on the same ledger cannot pay it twice.
        """
        tx = await self._chain.sign(
            [self._vault],
            transfer_instructions(
                self._vault.pubkey(),
                recipient,
                self._mint,
                amount,
                memo=f"kvasir-{kind}:{key}".encode(),
            ),
        )
        payout = Payout(str(tx.signatures[0]), kind, key, str(recipient), amount, "pending")
        with self._ledger.transaction() as db:
            if (left := available(db)) < amount:
                raise ClaimError(
                    f"the balance holds {left}, the payout needs {amount}: "
                    "another payout took it first; nothing was sent"
                )
            db.execute(
                "INSERT INTO settlement_payouts VALUES (?, ?, ?, ?, ?, ?, 'pending')",
                (payout.signature, kind, key, payout.recipient, amount, bytes(tx)),
            )
        return payout

    async def submit(self, payout: Payout) -> Payout:
        """Send a pending payout and finish it; ClaimError if it failed or is still pending."""
        tx = self.stored_transaction(payout.signature)
        sig = tx.signatures[0]
        try:
            await self._chain.send(tx)
        except ChainRefused as exc:
            # Refused before broadcast (preflight): it cannot land, unless it already had.
            if not (await self._chain.state(sig)).found:
                self._finish(payout, ok=False)
                raise ClaimError(
                    f"payout was refused by the chain ({exc}); balance unchanged"
                ) from None
        except ChainError as exc:
            # Outcome unknown (transport): it may still land, so it stays pending.
            raise ClaimError(
                f"payout {sig} is pending ({exc}); it is finished at next reconcile"
            ) from None
        return await self._settle(payout, sig)

    async def reconcile(self) -> list[Payout]:
        """Finish every pending payout left by a crash; returns them as they ended."""
        ended = []
        for (signature,) in self._ledger.db.execute(
            "SELECT signature FROM settlement_payouts WHERE state = 'pending'"
        ).fetchall():
            payout = self.payout(signature)
            async with self._locks.hold(_lock_key(payout)):
                ended.append(await self._reconcile_one(payout))
        return ended

    def payout(self, signature: str) -> Payout:
        row = self._ledger.one(
            "SELECT signature, kind, key, recipient, amount, state FROM "
            "settlement_payouts WHERE signature = ?",
            signature,
        )
        if row is None:
            raise ClaimError(f"no payout {signature}")
        return Payout(*row)

    async def _reconcile_one(self, payout: Payout) -> Payout:
        tx = self.stored_transaction(payout.signature)
        sig = tx.signatures[0]
        if not (await self._chain.state(sig)).found:
            try:
                await self._chain.send(tx, preflight=False)
            except ChainError:
                if not (
                    await self._chain.state(sig)
                ).found and not await self._chain.blockhash_valid(tx.message.recent_blockhash):
                    return self._finish(payout, ok=False)
        try:
            return await self._settle(payout, sig)
        except ClaimError:
            return self.payout(payout.signature)

    async def _settle(self, payout: Payout, sig: Signature) -> Payout:
        try:
            state = await self._chain.wait(sig, self._timeout)
        except ChainError as exc:
            raise ClaimError(
                f"payout {sig} is pending ({exc}); it is finished at next reconcile"
            ) from None
        ended = self._finish(payout, ok=state.error is None)
        if ended.state == "failed":
            raise ClaimError(
                f"payout {sig} failed on chain ({state.error}); balance unchanged: "
                "check the vault's KVR and SOL balances"
            )
        return ended

    def _finish(self, payout: Payout, ok: bool) -> Payout:
        with self._ledger.transaction() as db:
            moved = db.execute(
                "UPDATE settlement_payouts SET state = ? WHERE signature = ? AND state = 'pending'",
                ("done" if ok else "failed", payout.signature),
            )
            if moved.rowcount == 1 and ok:
                _debit(db, payout)
        return self.payout(payout.signature)

    def stored_transaction(self, signature: str) -> Transaction:
        """The exact signed payout transaction recorded before it was sent."""
        row = self._ledger.one("SELECT tx FROM settlement_payouts WHERE signature = ?", signature)
        if row is None:
            raise ClaimError(f"no payout {signature}")
        return Transaction.from_bytes(row[0])


def parse_claim(wire: dict[str, Any], peer_id: str, network: str) -> Pubkey:
    """The payout wallet of a claim sent by ``peer_id`` (authenticated by its libp2p connection).

    A claim carries only the peer's wallet link. Anything else a peer might add — units,
    role, tier, amount — is refused outright: the gateway measured the work itself.
    """
    extra = sorted(set(wire) - {"link"})
    if extra:
        raise ClaimError(
            f"claim carries {', '.join(extra)}: a claim names only the wallet link; "
            "the gateway measures work itself"
        )
    try:
        link = WalletLink.from_wire(wire.get("link") or {})
    except WalletError as exc:
        raise ClaimError(f"claim refused: {exc}") from None
    if link.peer_id != peer_id or link.network != network:
        raise ClaimError(
            f"wallet link is for {link.peer_id} on {link.network}, not {peer_id} on {network}"
        )
    return link.wallet


def _insurance_available(db: sqlite3.Connection) -> int:
    """The insurance pool less what pending refunds already reserve."""
    row = db.execute(
        "SELECT COALESCE((SELECT balance FROM settlement_pools WHERE name = 'insurance'), 0) - "
        "COALESCE((SELECT SUM(amount) FROM settlement_payouts WHERE kind = 'refund' "
        "AND state = 'pending'), 0)"
    ).fetchone()
    return int(row[0] or 0)


def _lock_key(payout: Payout) -> str:
    return f"peer:{payout.key}" if payout.kind == "claim" else "pool:insurance"


def _debit(db: sqlite3.Connection, payout: Payout) -> None:
    if payout.kind == "claim":
        db.execute(
            "UPDATE settlement_earnings SET paid = paid + ? WHERE peer_id = ?",
            (payout.amount, payout.key),
        )
    else:
        db.execute(
            "UPDATE settlement_pools SET balance = balance - ? WHERE name = 'insurance'",
            (payout.amount,),
        )
        db.execute(
            "UPDATE settlement_quotes SET state = 'refunded' WHERE request_id = ?", (payout.key,)
        )
