"""What a transaction proves, checked against what a payment claims.

Pure functions over ``ChainTransaction`` (the chain's own record: pre/post token
balances with owner and mint). A payment is accepted only when every check passes:

    the transaction exists at the required commitment and succeeded
    the vault's KVR token account rose by at least the amount        (vault received it)
    for a quote: a memo carries the quote's public reference         (bound to the private id)
    for a deposit credited to a wallet: the net KVR debit from token
    accounts owned by that wallet covers the amount                   (sender binding)

Signatures are public, so without sender binding anyone could present someone
else's transfer as their own deposit.
"""

from __future__ import annotations

from solders.pubkey import Pubkey

from kvasird.settlement.chain import ChainTransaction
from kvasird.settlement.errors import PaymentRejected
from kvasird.settlement.token import token_account


def vault_received(tx: ChainTransaction, vault_owner: Pubkey, mint: Pubkey) -> int:
    vault = token_account(vault_owner, mint)
    return sum(d.change for d in tx.token_deltas if d.account == vault and d.mint == mint)


def net_debit(tx: ChainTransaction, owner: Pubkey, mint: Pubkey) -> int:
    """How much ``mint`` left token accounts owned by ``owner``, net, in this transaction."""
    return -sum(d.change for d in tx.token_deltas if d.owner == owner and d.mint == mint)


def debited_owners(tx: ChainTransaction, mint: Pubkey) -> list[Pubkey]:
    """Owners whose ``mint`` balance fell, largest debit first."""
    owners = {d.owner for d in tx.token_deltas if d.mint == mint}
    debits = sorted(((net_debit(tx, o, mint), str(o), o) for o in owners), reverse=True)
    return [o for debit, _, o in debits if debit > 0]


def check_payment(
    tx: ChainTransaction | None,
    *,
    signature: str,
    vault_owner: Pubkey,
    mint: Pubkey,
    amount: int,
    memo: bytes | None = None,
    owner: Pubkey | None = None,
) -> None:
    """Raise PaymentRejected naming the first check the transaction fails."""
    if tx is None:
        raise PaymentRejected(
            f"transaction {signature} is unknown at the required commitment: "
            "check the signature, or wait until it is finalized and retry"
        )
    if tx.error is not None:
        raise PaymentRejected(
            f"transaction {signature} failed on chain ({tx.error}): no funds moved; "
            "send a new payment"
        )
    received = vault_received(tx, vault_owner, mint)
    if received <= 0:
        other = [d for d in tx.token_deltas if d.owner == vault_owner and d.change > 0]
        if other:
            raise PaymentRejected(
                f"transaction {signature} paid the vault in mint {other[0].mint}, "
                f"not KVR ({mint}): pay with KVR"
            )
        raise PaymentRejected(
            f"transaction {signature} did not pay the vault "
            f"{token_account(vault_owner, mint)}: pay the vault named in the quote"
        )
    if received < amount:
        raise PaymentRejected(
            f"transaction {signature} paid {received} base units, less than the "
            f"{amount} due: pay the full amount in one transaction"
        )
    if memo is not None and memo not in tx.memos:
        raise PaymentRejected(
            f"transaction {signature} does not carry this quote's payment reference: "
            "attach the quote's memo to the transfer"
        )
    if owner is not None and net_debit(tx, owner, mint) < amount:
        raise PaymentRejected(
            f"transaction {signature} was not sent by owner {owner}: "
            "only the wallet whose tokens moved can be credited"
        )
