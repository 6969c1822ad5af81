"""The settlement ledger: every money fact, in SQLite (WAL), changed only inside transactions.

Tables (all amounts integers in KVR base units):

    quotes           request_id (private), memo (public reference), amount, the tokens in and out
                     it covers and their prices, expiry, payer, signature, what its request
                     was charged once settled (the operator's own requests are quotes paid by
                     the vault itself, payer = the vault)
    used_signatures  signature PRIMARY KEY: a transaction pays for exactly one thing, ever
    deposits         prepaid balance per wallet (sender-bound deposits)
    earnings         per peer: earned (from measured work) and paid (confirmed payouts)
    pools            operator fee and insurance pool balances
    receipts         cumulative units/amount per (peer, epoch) the gateway signed
    payouts          on-chain payouts keyed by their transaction signature: pending → done | failed
    governance       applied network-parameter messages, by version
    admin_*          sign-in nonces, TOTP last step, session hashes, failed sign-in times
    peer_receipts    (peer side) the latest receipt from each gateway, and payouts verified on chain
    peer_gateways    (peer side) the peer id a paying gateway wallet speaks from (where claims go)
    refunds          the unserved part of each failed paid request, owed back from insurance
    gateway_redeemed paid quotes that have served a request (redemptions.py)

The database is the daemon's state.db; tables are created if missing.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS settlement_quotes (
    request_id TEXT PRIMARY KEY, memo TEXT NOT NULL UNIQUE, amount INTEGER NOT NULL,
    max_tokens INTEGER NOT NULL, price INTEGER NOT NULL, expires_at REAL NOT NULL,
    signature TEXT UNIQUE, payer TEXT, state TEXT NOT NULL DEFAULT 'open');
CREATE INDEX IF NOT EXISTS settlement_quotes_expiry ON settlement_quotes (state, expires_at);
CREATE TABLE IF NOT EXISTS settlement_used_signatures (
    signature TEXT PRIMARY KEY, purpose TEXT NOT NULL, key TEXT NOT NULL, amount INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_deposits (owner TEXT PRIMARY KEY, balance INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_earnings (
    peer_id TEXT PRIMARY KEY, earned INTEGER NOT NULL DEFAULT 0, paid INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS settlement_pools (name TEXT PRIMARY KEY, balance INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_work (
    request_id TEXT NOT NULL, peer_id TEXT NOT NULL, units INTEGER NOT NULL, tier TEXT NOT NULL,
    amount INTEGER NOT NULL, PRIMARY KEY (request_id, peer_id));
CREATE TABLE IF NOT EXISTS settlement_receipts (
    peer_id TEXT NOT NULL, epoch INTEGER NOT NULL, units INTEGER NOT NULL, amount INTEGER NOT NULL,
    seq INTEGER NOT NULL, PRIMARY KEY (peer_id, epoch));
CREATE TABLE IF NOT EXISTS settlement_payouts (
    signature TEXT PRIMARY KEY, kind TEXT NOT NULL, key TEXT NOT NULL, recipient TEXT NOT NULL,
    amount INTEGER NOT NULL, tx BLOB NOT NULL, state TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS settlement_payouts_pending ON settlement_payouts (state, key);
CREATE TABLE IF NOT EXISTS settlement_governance (
    version INTEGER PRIMARY KEY, message TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_admin_nonces (
    nonce TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_admin_totp (
    id INTEGER PRIMARY KEY CHECK (id = 1), secret TEXT NOT NULL, last_step INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_admin_sessions (
    token_hash TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_admin_failures (at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_peer_receipts (
    gateway TEXT NOT NULL, epoch INTEGER NOT NULL, amount INTEGER NOT NULL, seq INTEGER NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (gateway, epoch));
CREATE TABLE IF NOT EXISTS settlement_peer_payouts (
    signature TEXT PRIMARY KEY, gateway TEXT NOT NULL, amount INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_peer_gateways (
    gateway TEXT PRIMARY KEY, peer_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS settlement_refunds (
    request_id TEXT PRIMARY KEY, amount INTEGER NOT NULL);
"""

_ADDED_COLUMNS = (
    ("settlement_quotes", "prompt_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("settlement_quotes", "input_price", "INTEGER NOT NULL DEFAULT 0"),
    ("settlement_quotes", "charged", "INTEGER"),
)
"""Columns added after their table first shipped: added to a state.db that lacks them."""


class Ledger:
    """One SQLite connection; every write goes through ``transaction()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.executescript(_SCHEMA)
        for table, column, decl in _ADDED_COLUMNS:
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE … COMMIT, or ROLLBACK on any exception."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def one(self, sql: str, *args: object) -> tuple[Any, ...] | None:
        return self.db.execute(sql, args).fetchone()

    def value(self, sql: str, *args: object, default: int = 0) -> int:
        row = self.db.execute(sql, args).fetchone()
        return default if row is None or row[0] is None else int(row[0])
