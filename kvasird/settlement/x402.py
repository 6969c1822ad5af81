"""x402's ``exact`` scheme on Solana: the one transaction a payment is, built and checked.

x402 (HTTP 402 payments, V2) pays a resource with an SPL ``transferChecked`` that the
client signs and the resource's facilitator co-signs as fee payer and submits. Its layout
is fixed by the scheme, and so is what a fee payer may sign: the client's transaction is
a v0 message whose first signer is the fee payer named in the requirements' ``extra``
(its signature left empty) and whose second is the token owner, with exactly

    0  ComputeBudget SetComputeUnitLimit
    1  ComputeBudget SetComputeUnitPrice
    2  SPL Token TransferChecked  source -> the payTo's associated token account
    3  Memo                       the requirements' ``extra.memo``, no accounts

The gateway facilitates its own payments, so ``check_transfer`` is what stands between a
client's bytes and the gateway's signature: the fee payer's key appears in no instruction
(it pays the fee and authorises nothing else), the price of compute is bounded (the fee
payer pays it), and the transfer moves exactly the amount of KVR asked to the vault. A
transaction that passes is still only credited once the chain proves it landed (the quote's
settlement, ``Payments.settle_quote``); the memo binds it to one quote.

The x402 package's own Solana client needs solana-py's synchronous ``Client``, which solana
0.41 (the version kvasird pins) no longer has. ``ExactSvmClient`` is that client's part
written on what kvasird has: a scheme the package's ``x402Client`` registers for a network
like its own, building the same transaction from the same requirements.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from solders.compute_budget import ID as COMPUTE_BUDGET_ID
from solders.compute_budget import set_compute_unit_limit, set_compute_unit_price
from solders.hash import Hash
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import MessageV0, to_bytes_versioned
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.token.state import Mint
from solders.transaction import VersionedTransaction
from spl.memo.constants import MEMO_PROGRAM_ID
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import transfer_checked
from spl.token.models import TransferCheckedParams

from kvasird.settlement.errors import ChainError, PaymentRejected
from kvasird.settlement.token import token_account

SCHEME = "exact"
"""The x402 scheme: a transfer of exactly the amount asked."""
COMPUTE_UNIT_LIMIT = 20_000
"""Compute units a client asks for (a transfer and a memo use a fraction of it)."""
MAX_COMPUTE_UNIT_LIMIT = 200_000
"""The most compute units a payment may ask for: the fee payer pays for each."""
MAX_MICRO_LAMPORTS = 5_000_000
"""The highest compute-unit price a payment may bid (5 lamports a unit, as x402's own
facilitator allows): with the limit above, a priority fee of at most 0.001 SOL."""
_TRANSFER_CHECKED = 12
"""SPL Token's instruction tag for TransferChecked."""


def network_id(genesis_hash: str) -> str:
    """The CAIP-2 id of a Solana cluster, as x402 names networks: ``solana:`` and the first
    32 characters of its genesis hash (a kvasird local chain answers its mint as one)."""
    return f"solana:{genesis_hash[:32]}"


@dataclass(frozen=True)
class ExactTerms:
    """What a payment must be: the x402 requirements of one quote, as the chain sees them."""

    fee_payer: Pubkey
    """The gateway's wallet: it co-signs as fee payer (``extra.feePayer``)."""
    mint: Pubkey
    """The KVR mint (``asset``)."""
    pay_to: Pubkey
    """The vault's owner (``payTo``): the transfer goes to its associated token account."""
    amount: int
    """Base units to transfer, exactly (``amount``)."""
    memo: str
    """The quote's public payment reference (``extra.memo``)."""


def payment_transaction(
    payer: Keypair, terms: ExactTerms, decimals: int, blockhash: Hash
) -> VersionedTransaction:
    """The client's side: the scheme's transaction paying ``terms`` from ``payer``'s token
    account, signed by ``payer``, its fee payer's signature left for the facilitator."""
    transfer = transfer_checked(
        TransferCheckedParams(
            program_id=TOKEN_PROGRAM_ID,
            source=token_account(payer.pubkey(), terms.mint),
            mint=terms.mint,
            dest=token_account(terms.pay_to, terms.mint),
            owner=payer.pubkey(),
            amount=terms.amount,
            decimals=decimals,
        )
    )
    message = MessageV0.try_compile(
        terms.fee_payer,
        [
            set_compute_unit_limit(COMPUTE_UNIT_LIMIT),
            set_compute_unit_price(1),
            transfer,
            Instruction(MEMO_PROGRAM_ID, terms.memo.encode(), []),
        ],
        [],
        blockhash,
    )
    signature = payer.sign_message(to_bytes_versioned(message))
    return VersionedTransaction.populate(message, [Signature.default(), signature])


def decode_transaction(text: str) -> VersionedTransaction:
    """The payload's ``transaction`` (base64 of a serialized transaction)."""
    try:
        return VersionedTransaction.from_bytes(base64.b64decode(text, validate=True))
    except (ValueError, binascii.Error):
        raise PaymentRejected(
            "payload.transaction is not a base64-encoded Solana transaction: sign the "
            "payment again with an x402 client for Solana"
        ) from None


def memo_of(tx: VersionedTransaction) -> str:
    """The payment reference the transaction carries (which quote it pays)."""
    keys = tx.message.account_keys
    found = [
        bytes(ix.data)
        for ix in tx.message.instructions
        if keys[ix.program_id_index] == MEMO_PROGRAM_ID
    ]
    if len(found) != 1:
        raise PaymentRejected(
            f"the transaction carries {len(found)} memos: it must carry exactly one, the "
            "requirements' extra.memo (which quote it pays)"
        )
    return found[0].decode(errors="replace")


def check_transfer(tx: VersionedTransaction, terms: ExactTerms) -> Pubkey:
    """The payer of ``tx`` if it is the scheme's payment of ``terms`` that the fee payer may
    co-sign; else PaymentRejected naming the first rule it breaks. (Whether the terms still
    stand, their quote open and unexpired, is the quote's settlement's to say.)"""
    message = tx.message
    keys = list(message.account_keys)
    if not isinstance(message, MessageV0) or message.address_table_lookups:
        raise PaymentRejected("the payment must be a v0 transaction without lookup tables")
    if keys[0] != terms.fee_payer:
        raise PaymentRejected(
            f"the transaction's fee payer is {keys[0]}, not this gateway's {terms.fee_payer} "
            "(extra.feePayer)"
        )
    if message.header.num_required_signatures != 2 or len(tx.signatures) != 2:
        raise PaymentRejected(
            "the transaction must have exactly two signers: the fee payer, then the payer"
        )
    programs = [keys[ix.program_id_index] for ix in message.instructions]
    layout = [COMPUTE_BUDGET_ID, COMPUTE_BUDGET_ID, TOKEN_PROGRAM_ID, MEMO_PROGRAM_ID]
    if programs != layout:
        raise PaymentRejected(
            f"the transaction calls {', '.join(map(str, programs))}; the exact scheme is "
            "a compute-unit limit, a compute-unit price, an SPL Token transferChecked and "
            "one memo, in that order"
        )
    if any(0 in bytes(ix.accounts) for ix in message.instructions):
        raise PaymentRejected(
            "the fee payer appears in an instruction: it pays the fee and signs nothing else"
        )
    _check_compute(bytes(message.instructions[0].data), bytes(message.instructions[1].data))
    payer = _check_amount(message, keys, terms)
    if memo_of(tx) != terms.memo:
        raise PaymentRejected(
            "the transaction's memo is not this payment's extra.memo: pay the requirements "
            "the gateway sent"
        )
    if payer != keys[1] or not tx.signatures[1].verify(payer, to_bytes_versioned(message)):
        raise PaymentRejected(
            f"the payer's signature does not verify: {payer} must sign this very transaction"
        )
    return payer


def _check_compute(limit: bytes, price: bytes) -> None:
    if len(limit) != 5 or limit[0] != 2 or len(price) != 9 or price[0] != 3:
        raise PaymentRejected("the compute-budget instructions are not a unit limit and a price")
    units, micro_lamports = int.from_bytes(limit[1:], "little"), int.from_bytes(price[1:], "little")
    if units > MAX_COMPUTE_UNIT_LIMIT or micro_lamports > MAX_MICRO_LAMPORTS:
        raise PaymentRejected(
            f"the transaction asks for {units} compute units at {micro_lamports} micro-lamports: "
            f"at most {MAX_COMPUTE_UNIT_LIMIT} at {MAX_MICRO_LAMPORTS} (the gateway pays the fee)"
        )


def _check_amount(message: MessageV0, keys: list[Pubkey], terms: ExactTerms) -> Pubkey:
    """The transfer's owner, if the transfer moves exactly the KVR asked to the vault."""
    transfer = message.instructions[2]
    data, accounts = bytes(transfer.data), bytes(transfer.accounts)
    if len(data) != 10 or data[0] != _TRANSFER_CHECKED or len(accounts) != 4:
        raise PaymentRejected("instruction 2 is not an SPL Token transferChecked by one owner")
    _source, mint, destination, owner = (keys[i] for i in accounts)
    if mint != terms.mint:
        raise PaymentRejected(
            f"the transfer moves mint {mint}; this gateway takes KVR (mint {terms.mint})"
        )
    vault = token_account(terms.pay_to, terms.mint)
    if destination != vault:
        raise PaymentRejected(
            f"the transfer pays token account {destination}, not the vault {vault} "
            f"(payTo {terms.pay_to})"
        )
    amount = int.from_bytes(data[1:9], "little")
    if amount != terms.amount:
        raise PaymentRejected(
            f"the transfer moves {amount} base units; this request's requirements ask for "
            f"exactly {terms.amount}"
        )
    return owner


def cosigned(tx: VersionedTransaction, fee_payer: Keypair) -> VersionedTransaction:
    """``tx`` with the fee payer's signature: ready to submit (its first signature, the
    fee payer's, is the transaction's id)."""
    signature = fee_payer.sign_message(to_bytes_versioned(tx.message))
    return VersionedTransaction.populate(tx.message, [signature, tx.signatures[1]])


class Requirements(Protocol):
    """What ``ExactSvmClient`` reads of x402's PaymentRequirements."""

    asset: str
    pay_to: str
    amount: str
    extra: dict[str, Any]


class ExactSvmClient:
    """The ``exact`` scheme for Solana as a client of x402's ``x402Client``:
    ``client.register(network, ExactSvmClient(wallet, rpc_url))``. Reads the mint's decimals
    and, unless the requirements carry ``extra.recentBlockhash``, the latest blockhash from
    ``rpc_url`` (synchronously: the package calls schemes so)."""

    scheme = SCHEME

    def __init__(self, wallet: Keypair, rpc_url: str, timeout_s: float = 30.0) -> None:
        self.wallet = wallet
        self.rpc_url = rpc_url
        self._timeout = timeout_s
        self._ids = itertools.count(1)

    def create_payment_payload(self, requirements: Requirements) -> dict[str, Any]:
        """The scheme's payload: ``{"transaction": <base64 of the signed transaction>}``."""
        extra = requirements.extra or {}
        try:
            mint = Pubkey.from_string(requirements.asset)
            terms = ExactTerms(
                Pubkey.from_string(extra["feePayer"]),
                mint,
                Pubkey.from_string(requirements.pay_to),
                int(requirements.amount),
                str(extra.get("memo") or secrets.token_hex(16)),
            )
        except (KeyError, ValueError) as exc:
            raise PaymentRejected(
                f"the requirements cannot be paid by the exact scheme on Solana ({exc}): they "
                "need an asset, a payTo, an amount and extra.feePayer"
            ) from None
        hint = extra.get("recentBlockhash")
        blockhash = Hash.from_string(hint) if hint else self._latest_blockhash()
        tx = payment_transaction(self.wallet, terms, self._decimals(mint), blockhash)
        return {"transaction": base64.b64encode(bytes(tx)).decode()}

    def _decimals(self, mint: Pubkey) -> int:
        found = self._call("getAccountInfo", [str(mint), {"encoding": "base64"}])["value"]
        if found is None or found["owner"] != str(TOKEN_PROGRAM_ID):
            raise PaymentRejected(f"{mint} is not an SPL Token mint on {self.rpc_url}")
        return int(Mint.from_bytes(base64.b64decode(found["data"][0])).decimals)

    def _latest_blockhash(self) -> Hash:
        return Hash.from_string(self._call("getLatestBlockhash", [])["value"]["blockhash"])

    def _call(self, method: str, params: list[object]) -> Any:
        body = {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": params}
        try:
            reply = httpx.post(self.rpc_url, json=body, timeout=self._timeout).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ChainError(
                f"RPC {self.rpc_url} failed: {exc}: check that it is reachable"
            ) from None
        if "error" in reply:
            raise ChainError(f"{method} refused by {self.rpc_url}: {reply['error'].get('message')}")
        return reply["result"]
