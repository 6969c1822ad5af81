"""A private node's relay reservations on its own clock: a peer that refused to relay is
not asked again before REFUSED_BACKOFF_S (real libp2p hosts on 127.0.0.1, the clock moved by
hand)."""

from __future__ import annotations

import sqlite3

from libp2p.abc import INetStream
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL

from kvasird.p2p.peers import PeerTable
from kvasird.p2p.reachability import Reachability
from kvasird.p2p.relay import REFUSED_BACKOFF_S, Relays
from tests.support import Clock


async def test_a_peer_that_refused_a_reservation_is_asked_again_only_after_the_backoff(
        hosts) -> None:  # noqa: ANN001 - fixture factory
    clock, asked = Clock(1_800_000_000.0), []

    async def refuse(stream: INetStream) -> None:
        asked.append(clock.now)
        await stream.reset()

    async with hosts([None, None]) as (private, relay):
        relay.set_stream_handler(HOP_PROTOCOL, refuse)
        await private.connect(PeerInfo(relay.get_id(), relay.get_addrs()))
        peers = PeerTable(sqlite3.connect(":memory:"), clock)
        rid = relay.get_id().to_string()
        peers.connected(rid)
        peers.hello(rid, tuple(f"{a}/p2p/{rid}" for a in relay.get_addrs()), "test")
        relays = Relays(private, peers, "auto", 1, None, lambda: None, clock)
        relays.on_reachability(Reachability("private"))
        start = clock.now
        await relays._maintain()
        clock.now += REFUSED_BACKOFF_S - 1
        await relays._maintain()
        assert asked == [start] and not relays.reservations
        clock.now += 1.5
        await relays._maintain()
        assert asked == [start, start + REFUSED_BACKOFF_S + 0.5] and not relays.reservations
