"""The node's SQLite database (<home>/state.db): WAL, one connection per owner.

Subsystems declare their tables with ``ensure_schema`` and keep their own queries.
Every write happens inside ``with db:`` (one transaction), so a crash or kill loses
nothing that was acknowledged.

``connect`` checks the file before anyone uses it: SQLite would take an empty file for a
new database and answer a cut-short one only at the first query that touches a missing
page, so a damaged state.db would start a node that silently forgot its state, or end in
a traceback mid-start. The check (``PRAGMA quick_check``) reads every page once: about
1 ms per MB.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvasird.errors import HomeError

LOST = (
    "its known peers, which model units it holds (they are enrolled and fetched again; "
    "blobs still on disk are reused), and its settlement state: receipts not yet "
    "claimed, deposits, and which payments were already redeemed"
)
"""What a node forgets when it starts on a new state.db."""


def connect(path: Path, *, create: bool = False) -> sqlite3.Connection:
    """A connection to the database at `path`, created when missing; HomeError when the
    file is empty (unless `create`: a home being initialised) or not a whole database."""
    if not create and path.is_file() and path.stat().st_size == 0:
        raise damaged(path, "0 bytes")
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise damaged(path, str(exc)) from None
    if problems != ["ok"]:
        conn.close()
        raise damaged(path, "; ".join(problems))
    conn.isolation_level = "DEFERRED"  # implicit BEGIN again: `with conn:` commits or rolls back
    return conn


def damaged(path: Path, why: str) -> HomeError:
    """The error for a state.db that cannot be used, saying what to do about it."""
    return HomeError(
        f"{path} is damaged ({why}): restore it from a backup, or move it "
        f"aside to start with a new one; the node then forgets {LOST}"
    )


def ensure_schema(conn: sqlite3.Connection, statements: str) -> None:
    """Create tables/indexes idempotently (statements use IF NOT EXISTS)."""
    with conn:
        conn.executescript(statements)
