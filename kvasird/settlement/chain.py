"""The chain client: solana-py's AsyncClient, used the way that works under trio.

solana-py's ``confirm_transaction`` sleeps with asyncio and its rate limiter is
asyncio-only, so confirmation here polls ``getSignatureStatuses`` with ``trio.sleep``
and no rate limit is set. Transactions are fetched base64-encoded with
``max_supported_transaction_version=0`` and parsed by solders' typed
``GetTransactionResp``; token amounts are the integer ``amount`` strings (base units),
never ``uiAmount``. The same code talks to the embedded local chain and to any cluster.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import trio
from solana.exceptions import SolanaRpcException
from solana.rpc.async_api import AsyncClient
from solana.rpc.commitment import Commitment
from solana.rpc.core import RPCException
from solana.rpc.models import TxOpts
from solders.hash import Hash
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import Transaction, VersionedTransaction
from solders.transaction_status import EncodedTransactionWithStatusMeta, UiTransactionStatusMeta

from kvasird.settlement.errors import ChainError, ChainRefused
from kvasird.settlement.token import memos, token_account

T = TypeVar("T")
_COMMITMENT_RANK = {"processed": 0, "confirmed": 1, "finalized": 2}


@dataclass(frozen=True)
class TokenDelta:
    """One token account's balance around a transaction, as the chain recorded it."""

    account: Pubkey
    """The token account."""
    owner: Pubkey
    """Its owner (the wallet that can debit it)."""
    mint: Pubkey
    """Its mint."""
    pre: int
    """Base units before (0 if the account did not exist)."""
    post: int
    """Base units after (0 if it was closed)."""

    @property
    def change(self) -> int:
        return self.post - self.pre


@dataclass(frozen=True)
class ChainTransaction:
    """A landed transaction, reduced to what settlement checks."""

    signature: Signature
    """Its first signature."""
    slot: int
    """Slot it landed in."""
    error: str | None
    """None if it succeeded; otherwise the chain's error (balances did not move)."""
    fee_payer: Pubkey
    """First account key: who signed and paid the fee."""
    memos: tuple[bytes, ...]
    """Payloads of its top-level memo instructions."""
    token_deltas: tuple[TokenDelta, ...]
    """Every token account whose balance the chain reported before or after."""


@dataclass(frozen=True)
class NetworkKeys:
    """The two addresses a network's money is known by on its chain."""

    mint: Pubkey
    """The KVR mint."""
    genesis_wallet: Pubkey
    """The only signer of governance messages (on a local chain, its mint authority and
    faucet too)."""


@dataclass(frozen=True)
class SignatureState:
    """Where a signature stands."""

    found: bool
    """The cluster knows the signature."""
    reached: bool
    """It reached the required commitment."""
    error: str | None
    """Its error if it failed on chain."""


class ChainClient:
    """One RPC endpoint. Use ``async with ChainClient(url) as chain``."""

    def __init__(
        self,
        url: str,
        commitment: str = "finalized",
        poll_interval_s: float = 0.05,
        timeout_s: float = 30.0,
    ) -> None:
        self.url = url
        self._commitment = Commitment(commitment)
        self._poll = poll_interval_s
        self._rpc = AsyncClient(url, commitment=self._commitment, timeout=timeout_s)
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._ids = itertools.count(1)
        self._genesis = ""

    async def __aenter__(self) -> ChainClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._rpc.close()
        await self._http.aclose()

    async def healthy(self) -> bool:
        try:
            return (await self._rpc.is_connected()) is True
        except (SolanaRpcException, httpx.HTTPError):
            return False

    async def latest_blockhash(self) -> tuple[Hash, int]:
        resp = await self._call(self._rpc.get_latest_blockhash())
        return resp.value.blockhash, resp.value.last_valid_block_height

    async def blockhash_valid(self, blockhash: Hash) -> bool:
        """Whether a transaction on ``blockhash`` could still land (solana-py lacks this call)."""
        reply = await self.request(
            "isBlockhashValid", [str(blockhash), {"commitment": str(self._commitment)}]
        )
        return bool(reply["value"])  # type: ignore[index]

    async def genesis_hash(self) -> str:
        """The cluster's genesis hash (asked once: it names the cluster for good)."""
        if not self._genesis:
            self._genesis = str((await self._call(self._rpc.get_genesis_hash())).value)
        return self._genesis

    async def lamports(self, key: Pubkey) -> int:
        return int((await self._call(self._rpc.get_balance(key))).value)

    async def token_balance(self, owner: Pubkey, mint: Pubkey) -> int:
        """Base units in ``owner``'s associated token account (0 if it has none)."""
        try:
            resp = await self._rpc.get_token_account_balance(token_account(owner, mint))
        except RPCException:
            return 0
        except (SolanaRpcException, httpx.HTTPError) as exc:
            raise ChainError(f"RPC {self.url} failed: {exc}: check that it is reachable") from None
        return int(resp.value.amount)

    async def sign(
        self, signers: Sequence[Keypair], instructions: Sequence[Instruction]
    ) -> Transaction:
        """A transaction on the latest blockhash; its signature is known before it is sent."""
        blockhash, _ = await self.latest_blockhash()
        message = Message.new_with_blockhash(list(instructions), signers[0].pubkey(), blockhash)
        return Transaction(list(signers), message, blockhash)

    async def send(
        self, tx: Transaction | VersionedTransaction, preflight: bool = True
    ) -> Signature:
        """Submit; returns the signature without waiting for it to land."""
        opts = TxOpts(
            skip_confirmation=True,
            skip_preflight=not preflight,
            preflight_commitment=self._commitment,
        )
        return (await self._call(self._rpc.send_raw_transaction(bytes(tx), opts))).value

    async def send_and_confirm(
        self,
        signers: Sequence[Keypair],
        instructions: Sequence[Instruction],
        timeout_s: float = 30.0,
    ) -> Signature:
        sig = await self.send(await self.sign(signers, instructions))
        state = await self.wait(sig, timeout_s)
        if state.error is not None:
            raise ChainError(f"transaction {sig} failed on chain: {state.error}")
        return sig

    async def state(self, sig: Signature) -> SignatureState:
        resp = await self._call(
            self._rpc.get_signature_statuses([sig], search_transaction_history=True)
        )
        status = resp.value[0]
        if status is None:
            return SignatureState(False, False, None)
        level = (
            str(status.confirmation_status).rsplit(".", 1)[-1].lower()
            if status.confirmation_status
            else ""
        )
        reached = _COMMITMENT_RANK.get(level, -1) >= _COMMITMENT_RANK[str(self._commitment)]
        return SignatureState(True, reached, None if status.err is None else str(status.err))

    async def wait(self, sig: Signature, timeout_s: float) -> SignatureState:
        """Poll until ``sig`` reaches the commitment; ChainError after ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while True:
                state = await self.state(sig)
                if state.reached:
                    return state
                await trio.sleep(self._poll)
        raise ChainError(
            f"transaction {sig} did not reach {self._commitment} within {timeout_s:.0f} s: "
            "the RPC endpoint may be congested; it is reconciled later"
        )

    async def transaction(self, sig: Signature) -> ChainTransaction | None:
        """The transaction at the required commitment, or None if the chain has not got it."""
        resp = await self._call(
            self._rpc.get_transaction(
                sig,
                encoding="base64",
                commitment=self._commitment,
                max_supported_transaction_version=0,
            )
        )
        if resp.value is None:
            return None
        return _parse_transaction(sig, resp.value.slot, resp.value.transaction)

    async def request(self, method: str, params: list[object]) -> object:
        """A raw JSON-RPC call, for methods solana-py lacks and the local chain's own
        (``kvasir_requestTokens``, ``kvasir_localChain``)."""
        body = {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": params}
        try:
            reply = (await self._http.post(self.url, json=body)).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ChainError(
                f"RPC {self.url} failed: {exc}: check that it is reachable "
                "(for a local network: is `kvasird localchain` running?)"
            ) from None
        if "error" in reply:
            raise ChainRefused(f"{method} refused by {self.url}: {reply['error'].get('message')}")
        return reply["result"]

    async def local_chain_keys(self) -> NetworkKeys:
        """The mint and genesis wallet a kvasird local chain was born with, which it tells
        anyone who asks. A cluster has no such method: ChainRefused (it is not a local
        chain); ChainError while the URL does not answer."""
        info: Any = await self.request("kvasir_localChain", [])  # any JSON: checked below
        try:
            return NetworkKeys(
                Pubkey.from_string(info["mint"]),
                Pubkey.from_string(info["genesisWallet"]),
            )
        except (KeyError, TypeError, ValueError):
            raise ChainRefused(
                f"{self.url} answered kvasir_localChain without a mint and "
                "a genesis wallet: it is not a kvasird local chain"
            ) from None

    async def faucet(self, owner: Pubkey, kvr: int = 0, lamports: int = 0) -> None:
        """Fund ``owner`` on the local chain (SOL for fees, KVR base units) and wait for it."""
        sigs = []
        if lamports:
            sigs.append((await self._call(self._rpc.request_airdrop(owner, lamports))).value)
        if kvr:
            sigs.append(
                Signature.from_string(
                    str(await self.request("kvasir_requestTokens", [str(owner), kvr]))
                )
            )
        for sig in sigs:
            await self.wait(sig, 10.0)

    async def _call(self, coro: Awaitable[T]) -> T:
        try:
            return await coro
        except RPCException as exc:
            raise ChainRefused(f"RPC {self.url} refused: {_rpc_message(exc)}") from None
        except (SolanaRpcException, httpx.HTTPError) as exc:
            raise ChainError(
                f"RPC {self.url} failed: {exc.__cause__ or exc}: check that it is reachable"
            ) from None


def _rpc_message(exc: RPCException) -> str:
    arg = exc.args[0] if exc.args else exc
    return str(getattr(arg, "message", arg))


def _parse_transaction(
    sig: Signature, slot: int, encoded: EncodedTransactionWithStatusMeta
) -> ChainTransaction:
    tx = encoded.transaction
    if not isinstance(tx, VersionedTransaction):
        raise ChainError(f"RPC returned transaction {sig} in an unexpected encoding")
    meta = encoded.meta
    if meta is None:
        raise ChainError(f"RPC returned transaction {sig} without status metadata")
    keys = list(tx.message.account_keys)
    if meta.loaded_addresses is not None:
        keys += list(meta.loaded_addresses.writable) + list(meta.loaded_addresses.readonly)
    instructions = tx.message.instructions
    memo_data = memos(
        [keys[ix.program_id_index] for ix in instructions], [bytes(ix.data) for ix in instructions]
    )
    return ChainTransaction(
        sig,
        slot,
        None if meta.err is None else str(meta.err),
        keys[0],
        tuple(memo_data),
        _token_deltas(keys, meta),
    )


def _token_deltas(keys: list[Pubkey], meta: UiTransactionStatusMeta) -> tuple[TokenDelta, ...]:
    rows: dict[int, list] = {}  # account index -> [owner, mint, pre, post]
    for balances, slot in ((meta.pre_token_balances or [], 2), (meta.post_token_balances or [], 3)):
        for b in balances:
            if b.owner is None:
                continue
            row = rows.setdefault(b.account_index, [b.owner, b.mint, 0, 0])
            if (row[0], row[1]) != (b.owner, b.mint):
                raise ChainError("token account changed owner or mint inside one transaction")
            row[slot] = int(b.ui_token_amount.amount)
    return tuple(TokenDelta(keys[i], r[0], r[1], r[2], r[3]) for i, r in sorted(rows.items()))
