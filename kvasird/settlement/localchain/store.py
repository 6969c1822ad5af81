"""The local chain's durable state: a snapshot of every account a transaction touched,
the transaction history, and the recent blockhashes, in one SQLite file.

Each landed transaction is committed in one SQLite transaction (accounts + history +
new slot), so a killed local chain restarts exactly where the last landed transaction left it.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solders.account import Account
from solders.hash import Hash
from solders.pubkey import Pubkey

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (pubkey TEXT PRIMARY KEY, account BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS transactions (
    signature TEXT PRIMARY KEY, slot INTEGER NOT NULL, block_time INTEGER NOT NULL,
    tx BLOB NOT NULL, meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blockhashes (slot INTEGER PRIMARY KEY, blockhash TEXT NOT NULL);
"""


@dataclass(frozen=True)
class TransactionRecord:
    """A landed transaction as the chain recorded it."""

    signature: str
    """First signature, base58."""
    slot: int
    """Slot it landed in."""
    block_time: int
    """Unix time it landed."""
    tx: bytes
    """The transaction as sent (wire bytes)."""
    meta: dict[str, Any]
    """The JSON-RPC ``meta`` object (balances before/after, logs, err)."""


class ChainStore:
    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def accounts(self) -> Iterator[tuple[Pubkey, Account]]:
        for key, blob in self._db.execute("SELECT pubkey, account FROM accounts"):
            yield Pubkey.from_string(key), Account.from_bytes(blob)

    def blockhashes(self, limit: int) -> list[tuple[int, Hash]]:
        rows = self._db.execute(
            "SELECT slot, blockhash FROM blockhashes ORDER BY slot DESC LIMIT ?", (limit,)
        ).fetchall()
        return [(slot, Hash.from_string(h)) for slot, h in reversed(rows)]

    def transaction(self, signature: str) -> TransactionRecord | None:
        row = self._db.execute(
            "SELECT signature, slot, block_time, tx, meta FROM transactions WHERE signature = ?",
            (signature,),
        ).fetchone()
        if row is None:
            return None
        return TransactionRecord(row[0], row[1], row[2], row[3], json.loads(row[4]))

    def commit(
        self,
        slot: int,
        blockhash: Hash,
        accounts: dict[Pubkey, Account | None],
        record: TransactionRecord | None,
    ) -> None:
        """Atomically: the accounts as they are now, the new slot's blockhash, the record."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for key, account in accounts.items():
                if account is None:
                    self._db.execute("DELETE FROM accounts WHERE pubkey = ?", (str(key),))
                else:
                    self._db.execute(
                        "INSERT OR REPLACE INTO accounts VALUES (?, ?)", (str(key), bytes(account))
                    )
            self._db.execute("INSERT INTO blockhashes VALUES (?, ?)", (slot, str(blockhash)))
            if record is not None:
                self._db.execute(
                    "INSERT INTO transactions VALUES (?, ?, ?, ?, ?)",
                    (
                        record.signature,
                        record.slot,
                        record.block_time,
                        record.tx,
                        json.dumps(record.meta),
                    ),
                )
