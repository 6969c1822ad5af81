"""The peer table: who we are connected to, since when, last heard from, and how fast.

Written only by the liveness service (the single writer); everyone else reads snapshots.
Known peers' addresses are persisted in state.db so a restarted node can find its
way back without its bootstrap list. Times are unix time (they outlive the process), read
from the table's clock, so a test can age a peer past KNOWN_PEER_MAX_AGE_S.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvasird.db import ensure_schema

_SCHEMA = """
CREATE TABLE IF NOT EXISTS peers (
    peer_id   TEXT PRIMARY KEY,
    addrs     TEXT NOT NULL,
    last_seen REAL NOT NULL
);
"""
KNOWN_PEER_MAX_AGE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class PeerInfo:
    peer_id: str
    """libp2p peer id (base58)."""
    addrs: tuple[str, ...]
    """Addresses the peer announced in its hello, each ending in /p2p/<id>."""
    connected_since: float
    """Unix time we first saw this connection."""
    last_seen: float
    """Unix time of the last heartbeat answer or message from the peer."""
    rtt_ms: float | None
    """Last measured heartbeat round trip, None before the first."""
    version: str
    """The peer's kvasird version, from its hello ("" until received)."""

    def to_json(self) -> dict[str, object]:
        return {
            "peer_id": self.peer_id,
            "addrs": list(self.addrs),
            "connected_since": self.connected_since,
            "last_seen": self.last_seen,
            "rtt_ms": self.rtt_ms,
            "version": self.version,
        }


class PeerTable:
    def __init__(self, db: sqlite3.Connection, clock: Callable[[], float] = time.time) -> None:
        self._db, self._clock = db, clock
        self._peers: dict[str, PeerInfo] = {}
        ensure_schema(db, _SCHEMA)

    def snapshot(self) -> list[PeerInfo]:
        return sorted(self._peers.values(), key=lambda p: p.connected_since)

    def get(self, peer_id: str) -> PeerInfo | None:
        return self._peers.get(peer_id)

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def connected(self, peer_id: str) -> None:
        now = self._clock()
        if peer_id not in self._peers:
            self._peers[peer_id] = PeerInfo(peer_id, (), now, now, None, "")

    def hello(self, peer_id: str, addrs: tuple[str, ...], version: str) -> None:
        """Record a watched peer's hello (ignored for a peer that was dropped meanwhile)."""
        p = self._peers.get(peer_id)
        if p is None:
            return
        self._peers[peer_id] = replace(p, addrs=addrs, version=version, last_seen=self._clock())
        if addrs:
            with self._db:
                self._db.execute(
                    "INSERT INTO peers(peer_id, addrs, last_seen) VALUES (?, ?, ?) "
                    "ON CONFLICT(peer_id) DO UPDATE SET addrs=excluded.addrs, "
                    "last_seen=excluded.last_seen",
                    (peer_id, json.dumps(list(addrs)), self._clock()),
                )

    def seen(self, peer_id: str, rtt_ms: float | None = None) -> None:
        p = self._peers.get(peer_id)
        if p is not None:
            self._peers[peer_id] = replace(
                p, last_seen=self._clock(), rtt_ms=p.rtt_ms if rtt_ms is None else rtt_ms
            )

    def dropped(self, peer_id: str) -> PeerInfo | None:
        p = self._peers.pop(peer_id, None)
        if p is not None and p.addrs:
            with self._db:
                self._db.execute(
                    "UPDATE peers SET last_seen=? WHERE peer_id=?", (p.last_seen, peer_id)
                )
        return p

    def known(self) -> list[tuple[str, tuple[str, ...]]]:
        """Persisted peers seen within a week, most recent first (for re-dialing at start)."""
        rows = self._db.execute(
            "SELECT peer_id, addrs FROM peers WHERE last_seen > ? ORDER BY last_seen DESC",
            (self._clock() - KNOWN_PEER_MAX_AGE_S,),
        ).fetchall()
        return [(pid, tuple(json.loads(addrs))) for pid, addrs in rows]
