"""The peer table: what it remembers of peers across a restart, on a clock the test moves."""

from __future__ import annotations

import sqlite3

from kvasird.p2p.peers import KNOWN_PEER_MAX_AGE_S, PeerTable
from tests.support import Clock

ADDRS = ("/ip4/127.0.0.1/tcp/4001/p2p/A",)


def test_a_peer_not_seen_for_a_week_is_no_longer_redialled_at_start() -> None:
    db, clock = sqlite3.connect(":memory:"), Clock(1_800_000_000.0)
    peers = PeerTable(db, clock)
    peers.connected("A")
    peers.hello("A", ADDRS, "1.0")
    clock.now += 3600
    peers.seen("A")
    clock.now += 60
    assert peers.dropped("A") is not None
    restarted = PeerTable(db, clock)
    clock.now += KNOWN_PEER_MAX_AGE_S - 61
    assert restarted.known() == [("A", ADDRS)]  # a week since it last answered, less 1 s
    clock.now += 1
    assert restarted.known() == []


def test_a_peer_is_last_seen_when_it_last_answered() -> None:
    clock = Clock(1_800_000_000.0)
    peers = PeerTable(sqlite3.connect(":memory:"), clock)
    peers.connected("A")
    clock.now += 5
    peers.seen("A", rtt_ms=12.0)
    info = peers.get("A")
    assert info is not None
    assert (info.connected_since, info.last_seen, info.rtt_ms) == (1_800_000_000.0,
                                                                   1_800_000_005.0, 12.0)
