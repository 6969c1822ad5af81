"""JSON-RPC 2.0 methods of the local chain, in the shapes a Solana cluster answers.

Covers what solana-py's AsyncClient and kvasird use. Two methods are local-only:
``kvasir_requestTokens [owner, amount]`` mints KVR to ``owner`` (the faucet), and
``kvasir_localChain []`` says which mint and genesis wallet this chain was born with.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

from solders.hash import Hash
from solders.message import Message
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import VersionedTransaction

from kvasird.settlement.localchain.base58 import b58encode
from kvasird.settlement.localchain.chain import (
    BLOCKHASH_VALIDITY,
    LocalChain,
    RpcFailure,
    ui_amount_json,
)

_VERSION = {"solana-core": "2.2.0-kvasird-localchain", "feature-set": 0}
MAX_REQUEST_BYTES = 4 << 20
"""Largest JSON-RPC request body accepted."""


class RpcHandler:
    """Maps a JSON-RPC request body to a response body."""

    def __init__(self, chain: LocalChain) -> None:
        self._chain = chain
        self._methods: dict[str, Callable[[list[Any]], Any]] = {
            "getHealth": lambda _: "ok",
            "getVersion": lambda _: _VERSION,
            "getSlot": lambda _: chain.slot,
            "getBlockHeight": lambda _: chain.slot,
            "getGenesisHash": lambda _: str(chain.mint),
            "getLatestBlockhash": self._latest_blockhash,
            "isBlockhashValid": self._blockhash_valid,
            "sendTransaction": self._send,
            "simulateTransaction": self._simulate,
            "getTransaction": self._transaction,
            "getSignatureStatuses": self._statuses,
            "getBalance": lambda p: self._context(self._lamports(_pubkey(p, 0))),
            "getAccountInfo": self._account_info,
            "getTokenAccountBalance": self._token_balance,
            "getMinimumBalanceForRentExemption": lambda p: chain.minimum_balance(int(p[0])),
            "requestAirdrop": lambda p: str(chain.airdrop(_pubkey(p, 0), _amount(p, 1))),
            "kvasir_requestTokens": lambda p: str(chain.faucet_kvr(_pubkey(p, 0), _amount(p, 1))),
            "kvasir_localChain": lambda _: {
                "mint": str(chain.mint),
                "genesisWallet": str(chain.authority),
            },
        }

    def handle(self, body: bytes) -> bytes:
        try:
            request = json.loads(body)
        except ValueError:
            return _dump(_error(None, -32700, "Parse error"))
        if isinstance(request, list):
            return _dump([self._one(r) for r in request])
        return _dump(self._one(request))

    def _one(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict) or not isinstance(request.get("method"), str):
            return _error(None, -32600, "Invalid request")
        rid = request.get("id")
        method = self._methods.get(request["method"])
        if method is None:
            return _error(rid, -32601, "Method not found")
        params = request.get("params") or []
        try:
            return {
                "jsonrpc": "2.0",
                "result": method(params if isinstance(params, list) else [params]),
                "id": rid,
            }
        except RpcFailure as exc:
            return _error(rid, exc.code, exc.message, exc.data)
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            return _error(rid, -32602, f"Invalid params: {exc}")
        except Exception as exc:  # one bad request must not stop the chain for everyone
            return _error(rid, -32603, f"Internal error: {type(exc).__name__}: {exc}")

    def _context(self, value: Any) -> dict[str, Any]:
        return {
            "context": {"slot": self._chain.slot, "apiVersion": _VERSION["solana-core"]},
            "value": value,
        }

    def _lamports(self, key: Pubkey) -> int:
        account = self._chain.account(key)
        return 0 if account is None else account.lamports

    def _latest_blockhash(self, _: list[Any]) -> dict[str, Any]:
        latest = self._chain.latest_blockhash()
        return self._context(
            {
                "blockhash": str(latest.hash),
                "lastValidBlockHeight": latest.slot + BLOCKHASH_VALIDITY,
            }
        )

    def _blockhash_valid(self, params: list[Any]) -> dict[str, Any]:
        return self._context(self._chain.blockhash_valid(Hash.from_string(params[0])))

    def _send(self, params: list[Any]) -> str:
        config = _config(params)
        wire = _decode_wire(params[0], config.get("encoding", "base58"))
        return str(self._chain.send(wire, preflight=not config.get("skipPreflight", False)))

    def _simulate(self, params: list[Any]) -> dict[str, Any]:
        config = _config(params)
        return self._context(
            self._chain.simulate(_decode_wire(params[0], config.get("encoding", "base58")))
        )

    def _transaction(self, params: list[Any]) -> dict[str, Any] | None:
        config = _config(params)
        record = self._chain.transaction(str(Signature.from_string(params[0])))
        if record is None:
            return None
        encoding = config.get("encoding", "json")
        if encoding == "base64":
            transaction: Any = [base64.b64encode(record.tx).decode(), "base64"]
        elif encoding in ("json", "jsonParsed"):
            transaction = _transaction_json(VersionedTransaction.from_bytes(record.tx))
        else:
            raise ValueError(f"unsupported encoding {encoding!r} (use base64 or json)")
        result = {
            "slot": record.slot,
            "blockTime": record.block_time,
            "meta": record.meta,
            "transaction": transaction,
        }
        if "maxSupportedTransactionVersion" in config:
            legacy = isinstance(VersionedTransaction.from_bytes(record.tx).message, Message)
            result["version"] = "legacy" if legacy else 0
        return result

    def _statuses(self, params: list[Any]) -> dict[str, Any]:
        values = []
        for text in params[0]:
            record = self._chain.transaction(str(Signature.from_string(text)))
            values.append(
                None
                if record is None
                else {
                    "slot": record.slot,
                    "confirmations": None,
                    "err": record.meta["err"],
                    "status": record.meta["status"],
                    "confirmationStatus": "finalized",
                }
            )
        return self._context(values)

    def _account_info(self, params: list[Any]) -> dict[str, Any]:
        account = self._chain.account(_pubkey(params, 0))
        if account is None:
            return self._context(None)
        return self._context(
            {
                "data": [base64.b64encode(bytes(account.data)).decode(), "base64"],
                "executable": account.executable,
                "lamports": account.lamports,
                "owner": str(account.owner),
                "rentEpoch": account.rent_epoch,
                "space": len(account.data),
            }
        )

    def _token_balance(self, params: list[Any]) -> dict[str, Any]:
        found = self._chain.token_amount(_pubkey(params, 0))
        if found is None:
            raise RpcFailure(-32602, "Invalid param: could not find account")
        return self._context(ui_amount_json(*found))


def _config(params: list[Any]) -> dict[str, Any]:
    return params[1] if len(params) > 1 and isinstance(params[1], dict) else {}


def _pubkey(params: list[Any], index: int) -> Pubkey:
    return Pubkey.from_string(params[index])


def _amount(params: list[Any], index: int) -> int:
    value = params[index]
    if not isinstance(value, int) or value <= 0:
        raise ValueError("amount must be a positive integer")
    return value


def _decode_wire(data: str, encoding: str) -> bytes:
    if encoding != "base64":
        raise RpcFailure(-32602, "Invalid params: only base64-encoded transactions are accepted")
    return base64.b64decode(data)


def _transaction_json(tx: VersionedTransaction) -> dict[str, Any]:
    msg = tx.message
    header = msg.header
    message: dict[str, Any] = {
        "accountKeys": [str(k) for k in msg.account_keys],
        "header": {
            "numRequiredSignatures": header.num_required_signatures,
            "numReadonlySignedAccounts": header.num_readonly_signed_accounts,
            "numReadonlyUnsignedAccounts": header.num_readonly_unsigned_accounts,
        },
        "recentBlockhash": str(msg.recent_blockhash),
        "instructions": [
            {
                "programIdIndex": ix.program_id_index,
                "accounts": list(ix.accounts),
                "data": b58encode(bytes(ix.data)),
                "stackHeight": None,
            }
            for ix in msg.instructions
        ],
    }
    if hasattr(msg, "address_table_lookups"):
        message["addressTableLookups"] = []
    return {"signatures": [str(s) for s in tx.signatures], "message": message}


def _error(rid: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "error": error, "id": rid}


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
