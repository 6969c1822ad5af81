"""Which paid quotes have served a request: each pays for one.

The gateway redeems a payment in the same transaction that checks it was unused, before
any work starts, and releases it when its request did no work (refused or failed before
its first token), so that the same payment header pays for the request sent again.
"""

from __future__ import annotations

import sqlite3
import time

from kvasird.settlement.ledger import Ledger

_SCHEMA = """
CREATE TABLE IF NOT EXISTS gateway_redeemed (
    request_id TEXT PRIMARY KEY,
    redeemed_at REAL NOT NULL
);
"""


class Redemptions:
    """The gateway's record of spent payments, by request id (in the settlement ledger)."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        ledger.db.executescript(_SCHEMA)

    def redeem(self, request_id: str) -> bool:
        """Spend ``request_id``'s payment on a request; False when a request spent it already."""
        try:
            with self._ledger.transaction() as db:
                db.execute("INSERT INTO gateway_redeemed VALUES (?, ?)", (request_id, time.time()))
        except sqlite3.IntegrityError:
            return False
        return True

    def redeemed(self, request_id: str) -> bool:
        return (
            self._ledger.one("SELECT 1 FROM gateway_redeemed WHERE request_id = ?", request_id)
            is not None
        )

    def release(self, request_id: str) -> None:
        """Make a redeemed payment usable again: its request did no work."""
        with self._ledger.transaction() as db:
            db.execute("DELETE FROM gateway_redeemed WHERE request_id = ?", (request_id,))
