"""Heartbeats and dead-peer detection on trio's virtual clock, between two nodes joined by
an in-memory link that can go silent the way a dead machine's connection does (py-libp2p
keeps it "connected"; nothing arrives on it any more)."""

from __future__ import annotations

import sqlite3
from typing import Any

import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from trio.testing import MockClock

from kvasird import PROTOCOL_VERSION
from kvasird.p2p.hello import Hello
from kvasird.p2p.liveness import Liveness
from kvasird.p2p.peers import PeerTable
from tests.support import eventually_async

INTERVAL_S, TIMEOUT_S = 1.0, 3.0


class Link:
    """Two hosts' connection; once `silent`, whatever is written on it is lost."""

    def __init__(self) -> None:
        self.silent = False


class Stream:
    """One end of a stream over a Link (what liveness uses of INetStream)."""

    def __init__(self, end: trio.testing.MemoryStapledStream, peer: ID, link: Link) -> None:
        self.end, self.link = end, link
        self.muxed_conn = type("Conn", (), {"peer_id": peer})()

    async def read(self, n: int) -> bytes:
        return await self.end.receive_some(n)

    async def write(self, data: bytes) -> None:
        if not self.link.silent:
            await self.end.send_all(data)

    async def close(self) -> None:
        await self.end.aclose()

    reset = close


class Host:
    """What liveness uses of a libp2p host: its handlers, its peers, new streams to them."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.id = ID.from_pubkey(create_new_key_pair().public_key)
        self.nursery = nursery
        self.handlers: dict[str, Any] = {}
        self.links: dict[ID, tuple[Host, Link]] = {}

    def set_stream_handler(self, protocol: str, handler: Any) -> None:
        self.handlers[protocol] = handler

    def get_connected_peers(self) -> list[ID]:
        return list(self.links)

    async def new_stream(self, peer: ID, protocols: list[str]) -> Stream:
        other, link = self.links[peer]
        ours, theirs = trio.testing.memory_stream_pair()
        other.nursery.start_soon(other.handlers[protocols[0]], Stream(theirs, self.id, link))
        return Stream(ours, peer, link)

    def get_network(self) -> Host:
        return self

    async def close_peer(self, peer: ID) -> None:
        self.links.pop(peer, None)


def node(nursery: trio.Nursery) -> tuple[Host, PeerTable, Liveness]:
    host, peers = Host(nursery), PeerTable(sqlite3.connect(":memory:"))
    hello = Hello("net", PROTOCOL_VERSION, "test", ())
    return host, peers, Liveness(host, peers, lambda: hello, INTERVAL_S, TIMEOUT_S)


async def test_a_peer_gone_silent_is_dropped_within_the_timeout_and_one_interval(
        autojump_clock: MockClock) -> None:
    async with trio.open_nursery() as nursery:
        (a, a_peers, a_live), (b, b_peers, b_live) = node(nursery), node(nursery)
        await nursery.start(a_live.run)
        await nursery.start(b_live.run)
        link = Link()  # they connect
        a.links[b.id], b.links[a.id] = (b, link), (a, link)
        await trio.sleep(10 * TIMEOUT_S)  # heartbeats both ways keep each other in
        for peers, other in ((a_peers, b), (b_peers, a)):
            info = peers.get(other.id.to_string())
            assert info is not None and info.rtt_ms is not None
        link.silent = True
        went = trio.current_time()
        await eventually_async("each dropped the other", lambda: b.id.to_string() not in a_peers
                               and a.id.to_string() not in b_peers,
                               timeout=TIMEOUT_S + INTERVAL_S + 1)
        assert TIMEOUT_S - INTERVAL_S <= trio.current_time() - went <= TIMEOUT_S + INTERVAL_S + 0.1
        assert not a.links and not b.links  # each closed its connection to the other
        nursery.cancel_scope.cancel()
