"""LiteSVM wrapped into a chain that behaves, for a client, like a one-validator cluster.

LiteSVM executes transactions but records no slot, account keys, or token balances,
and accepts only its latest blockhash. This wrapper keeps what a cluster would:
slots (one per landed transaction) with their own blockhashes, valid for
BLOCKHASH_VALIDITY slots; the lamport and SPL-token balances of every account of a
transaction before and after it runs (``preTokenBalances``/``postTokenBalances`` with
owner and mint); and the history, persisted in ``ChainStore``. Everything is final as
soon as it lands (one validator): statuses report ``finalized``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solders.account import Account
from solders.hash import Hash
from solders.keypair import Keypair
from solders.litesvm import LiteSVM
from solders.message import Message
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.system_program import ID as SYSTEM_PROGRAM_ID
from solders.system_program import CreateAccountParams, TransferParams, create_account, transfer
from solders.token.state import Mint, TokenAccount
from solders.transaction import Transaction, VersionedTransaction
from solders.transaction_metadata import FailedTransactionMetadata, TransactionMetadata
from solders.transaction_status import (
    InstructionErrorCustom,
    InstructionErrorFieldless,
    TransactionErrorFieldless,
    TransactionErrorInstructionError,
)
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import initialize_mint2
from spl.token.models import InitializeMint2Params

from kvasird.settlement.localchain.base58 import b58encode
from kvasird.settlement.localchain.genesis import load_or_create_genesis
from kvasird.settlement.localchain.store import ChainStore, TransactionRecord
from kvasird.settlement.token import KVR_DECIMALS, mint_instructions

BLOCKHASH_VALIDITY = 150
"""Slots a blockhash stays usable, as on a real cluster."""
FAUCET_LAMPORTS = 10**16
"""Lamports the genesis authority starts with (it pays airdrops and faucet fees)."""
_MINT_SIZE = 82
_TOKEN_ACCOUNT_SIZE = 165


class RpcFailure(Exception):
    """A JSON-RPC error answer: the transaction did not land."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


@dataclass(frozen=True)
class Blockhash:
    """A blockhash this chain handed out."""

    hash: Hash
    """The hash itself."""
    slot: int
    """The slot it belongs to; valid until slot + BLOCKHASH_VALIDITY."""


class LocalChain:
    """One LiteSVM with its history; not thread-safe, driven from one trio task at a time."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.genesis, fresh = load_or_create_genesis(data_dir / "genesis.json")
        self._store = ChainStore(data_dir / "chain.db")
        self._svm = LiteSVM().with_blockhash_check(False)
        self._decimals: dict[Pubkey, int] = {}
        self._recent: list[Blockhash] = [
            Blockhash(h, s) for s, h in self._store.blockhashes(BLOCKHASH_VALIDITY)
        ]
        for key, account in self._store.accounts():
            self._svm.set_account(key, account)
        if fresh or not self._recent:
            self._create_genesis()

    def close(self) -> None:
        self._store.close()

    @property
    def mint(self) -> Pubkey:
        return self.genesis.mint.pubkey()

    @property
    def authority(self) -> Pubkey:
        return self.genesis.authority.pubkey()

    @property
    def slot(self) -> int:
        return self._recent[-1].slot

    def latest_blockhash(self) -> Blockhash:
        return self._recent[-1]

    def blockhash_valid(self, blockhash: Hash) -> bool:
        return any(b.hash == blockhash for b in self._recent)

    def account(self, key: Pubkey) -> Account | None:
        return self._svm.get_account(key)

    def minimum_balance(self, size: int) -> int:
        return self._svm.minimum_balance_for_rent_exemption(size)

    def token_amount(self, key: Pubkey) -> tuple[int, int] | None:
        """(amount, decimals) of an SPL token account, None if ``key`` is not one."""
        parsed = self._token_account(self.account(key))
        return None if parsed is None else (parsed.amount, self._mint_decimals(parsed.mint))

    def transaction(self, signature: str) -> TransactionRecord | None:
        return self._store.transaction(signature)

    # -- sending ---------------------------------------------------------------------------

    def send(self, wire: bytes, preflight: bool = True) -> Signature:
        try:
            tx = VersionedTransaction.from_bytes(wire)
        except ValueError:
            raise RpcFailure(-32602, "invalid transaction: failed to deserialize") from None
        if preflight:
            sim = self._svm.simulate_transaction(tx)
            if isinstance(sim, FailedTransactionMetadata):
                meta = sim.meta()
                raise RpcFailure(
                    -32002,
                    f"Transaction simulation failed: {sim.err()}",
                    {
                        "err": error_json(sim.err()),
                        "logs": list(meta.logs()),
                        "accounts": None,
                        "unitsConsumed": meta.compute_units_consumed(),
                        "returnData": None,
                    },
                )
        return self._execute(tx, wire)

    def simulate(self, wire: bytes) -> dict[str, Any]:
        tx = VersionedTransaction.from_bytes(wire)
        sim = self._svm.simulate_transaction(tx)
        err = error_json(sim.err()) if isinstance(sim, FailedTransactionMetadata) else None
        meta = sim.meta()
        return {
            "err": err,
            "logs": list(meta.logs()),
            "accounts": None,
            "unitsConsumed": meta.compute_units_consumed(),
            "returnData": None,
        }

    def airdrop(self, to: Pubkey, lamports: int) -> Signature:
        """Lamports from the genesis authority (the faucet), as a real transaction."""
        ix = transfer(TransferParams(from_pubkey=self.authority, to_pubkey=to, lamports=lamports))
        return self._sign_and_execute([ix], [self.genesis.authority])

    def faucet_kvr(self, owner: Pubkey, amount: int) -> Signature:
        """Mint ``amount`` base units of KVR to ``owner``'s token account (local networks only)."""
        return self._sign_and_execute(
            mint_instructions(self.authority, owner, self.mint, amount), [self.genesis.authority]
        )

    def _sign_and_execute(self, ixs: list[Any], signers: list[Keypair]) -> Signature:
        blockhash = self.latest_blockhash().hash
        tx = Transaction(
            signers, Message.new_with_blockhash(ixs, signers[0].pubkey(), blockhash), blockhash
        )
        wire = bytes(tx)
        return self._execute(VersionedTransaction.from_bytes(wire), wire)

    def _create_genesis(self) -> None:
        self._svm.set_account(
            self.authority, Account(FAUCET_LAMPORTS, b"", SYSTEM_PROGRAM_ID, False, 0)
        )
        self._advance({self.authority: self.account(self.authority)}, None, Hash.default())
        mint = self.genesis.mint
        self._sign_and_execute(
            [
                create_account(
                    CreateAccountParams(
                        from_pubkey=self.authority,
                        to_pubkey=mint.pubkey(),
                        lamports=self.minimum_balance(_MINT_SIZE),
                        space=_MINT_SIZE,
                        owner=TOKEN_PROGRAM_ID,
                    )
                ),
                initialize_mint2(
                    InitializeMint2Params(
                        decimals=KVR_DECIMALS,
                        program_id=TOKEN_PROGRAM_ID,
                        mint=mint.pubkey(),
                        mint_authority=self.authority,
                        freeze_authority=None,
                    )
                ),
            ],
            [self.genesis.authority, mint],
        )

    def _execute(self, tx: VersionedTransaction, wire: bytes) -> Signature:
        signature = tx.signatures[0]
        if self._store.transaction(str(signature)) is not None:
            raise RpcFailure(
                -32002,
                "Transaction simulation failed: This transaction has already been processed",
                {
                    "err": "AlreadyProcessed",
                    "logs": [],
                    "accounts": None,
                    "unitsConsumed": 0,
                    "returnData": None,
                },
            )
        if not self.blockhash_valid(tx.message.recent_blockhash):
            raise RpcFailure(
                -32002,
                "Transaction simulation failed: Blockhash not found",
                {
                    "err": "BlockhashNotFound",
                    "logs": [],
                    "accounts": None,
                    "unitsConsumed": 0,
                    "returnData": None,
                },
            )
        keys = list(tx.message.account_keys)
        pre_lamports, pre_tokens = self._balances(keys)
        result = self._svm.send_transaction(tx)
        if isinstance(result, FailedTransactionMetadata):
            err = result.err()
            if isinstance(err, TransactionErrorFieldless):
                raise RpcFailure(-32003, f"Transaction failed: {err}", {"err": error_json(err)})
            meta_obj, err_json = result.meta(), error_json(err)
        else:
            meta_obj, err_json = result, None
        post_lamports, post_tokens = self._balances(keys)
        meta = _meta_json(meta_obj, err_json, pre_lamports, post_lamports, pre_tokens, post_tokens)
        record = TransactionRecord(str(signature), self.slot + 1, int(time.time()), wire, meta)
        self._advance({k: self.account(k) for k in keys}, record, self.latest_blockhash().hash)
        return signature

    def _advance(
        self,
        accounts: dict[Pubkey, Account | None],
        record: TransactionRecord | None,
        previous: Hash,
    ) -> None:
        """Close the current slot: persist its effects and hand out the next blockhash."""
        slot = self.slot + 1 if self._recent else 0
        blockhash = Hash(hashlib.sha256(bytes(previous) + slot.to_bytes(8, "little")).digest())
        self._store.commit(slot, blockhash, accounts, record)
        self._recent = [*self._recent[-(BLOCKHASH_VALIDITY - 1) :], Blockhash(blockhash, slot)]

    def _balances(self, keys: list[Pubkey]) -> tuple[list[int], list[dict[str, Any]]]:
        lamports, tokens = [], []
        for index, key in enumerate(keys):
            account = self.account(key)
            lamports.append(0 if account is None else account.lamports)
            parsed = self._token_account(account)
            if parsed is not None:
                tokens.append(token_balance_json(index, parsed, self._mint_decimals(parsed.mint)))
        return lamports, tokens

    @staticmethod
    def _token_account(account: Account | None) -> TokenAccount | None:
        if (
            account is None
            or account.owner != TOKEN_PROGRAM_ID
            or len(account.data) != _TOKEN_ACCOUNT_SIZE
        ):
            return None
        return TokenAccount.from_bytes(bytes(account.data))

    def _mint_decimals(self, mint: Pubkey) -> int:
        if mint not in self._decimals:
            account = self.account(mint)
            self._decimals[mint] = Mint.from_bytes(bytes(account.data)).decimals if account else 0
        return self._decimals[mint]


def ui_amount_json(amount: int, decimals: int) -> dict[str, Any]:
    text = str(amount).rjust(decimals + 1, "0")
    ui = f"{text[:-decimals]}.{text[-decimals:]}".rstrip("0").rstrip(".") if decimals else text
    return {
        "amount": str(amount),
        "decimals": decimals,
        "uiAmount": float(ui),
        "uiAmountString": ui,
    }


def token_balance_json(index: int, account: TokenAccount, decimals: int) -> dict[str, Any]:
    return {
        "accountIndex": index,
        "mint": str(account.mint),
        "owner": str(account.owner),
        "programId": str(TOKEN_PROGRAM_ID),
        "uiTokenAmount": ui_amount_json(account.amount, decimals),
    }


def error_json(err: Any) -> Any:
    """A LiteSVM transaction error in the JSON shape a cluster's RPC uses."""
    if isinstance(err, TransactionErrorFieldless):
        return str(err).rsplit(".", 1)[-1]
    if isinstance(err, TransactionErrorInstructionError):
        inner = err.err
        if isinstance(inner, InstructionErrorCustom):
            return {"InstructionError": [err.index, {"Custom": inner.code}]}
        if isinstance(inner, InstructionErrorFieldless):
            return {"InstructionError": [err.index, str(inner).rsplit(".", 1)[-1]]}
        return {"InstructionError": [err.index, str(inner)]}
    return str(err)


def _meta_json(
    meta: TransactionMetadata,
    err: Any,
    pre_lamports: list[int],
    post_lamports: list[int],
    pre_tokens: list[dict[str, Any]],
    post_tokens: list[dict[str, Any]],
) -> dict[str, Any]:
    inner = [
        {
            "index": i,
            "instructions": [
                {
                    "programIdIndex": ix.instruction().program_id_index,
                    "accounts": list(ix.instruction().accounts),
                    "data": b58encode(bytes(ix.instruction().data)),
                    "stackHeight": ix.stack_height(),
                }
                for ix in group
            ],
        }
        for i, group in enumerate(meta.inner_instructions())
        if group
    ]
    return {
        "err": err,
        "status": {"Ok": None} if err is None else {"Err": err},
        "fee": meta.fee(),
        "preBalances": pre_lamports,
        "postBalances": post_lamports,
        "innerInstructions": inner,
        "logMessages": list(meta.logs()),
        "preTokenBalances": pre_tokens,
        "postTokenBalances": post_tokens,
        "rewards": [],
        "loadedAddresses": {"writable": [], "readonly": []},
        "computeUnitsConsumed": meta.compute_units_consumed(),
    }
