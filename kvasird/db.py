"""The node's SQLite database (<home>/state.db): WAL, one connection per owner.

Subsystems declare their tables with ``ensure_schema`` and keep their own queries.
Every write happens inside ``with db:`` (one transaction), so a crash or kill loses
nothing that was acknowledged.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.isolation_level = ""  # back to implicit transactions: `with conn:` commits or rolls back
    return conn


def ensure_schema(conn: sqlite3.Connection, statements: str) -> None:
    """Create tables/indexes idempotently (statements use IF NOT EXISTS)."""
    with conn:
        conn.executescript(statements)
