"""P2PNode: the host and its services in one nursery, started in order."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import multiaddr
import trio

from kvasird import PROTOCOL_VERSION, __version__
from kvasird.config import P2PConfig
from kvasird.identity import NodeKey
from kvasird.logs import get_logger
from kvasird.p2p.dialer import Dialer
from kvasird.p2p.exchange import PeerExchange
from kvasird.p2p.gossip import Gossip
from kvasird.p2p.hello import Hello
from kvasird.p2p.host import build_host, dialable_addrs, parse_listen
from kvasird.p2p.liveness import Liveness
from kvasird.p2p.peers import PeerTable

log = get_logger("kvasird.p2p")


class P2PNode:
    def __init__(self, key: NodeKey, config: P2PConfig, network: str, db: sqlite3.Connection) -> None:
        self.key = key
        self.config = config
        self.network = network
        self.listen = parse_listen(config.listen)
        self.host = build_host(key, self.listen, list(config.announce), config.max_peers)
        self.peers = PeerTable(db)
        self.dialer = Dialer(self.host, config.max_peers)
        self.gossip = Gossip(self.host, network)
        self.liveness = Liveness(self.host, self.peers, self.hello, config.heartbeat_interval_s,
                                 config.liveness_timeout_s)
        self.exchange = PeerExchange(self.host, self.peers, self.dialer,
                                     config.peer_exchange_interval_s)

    @property
    def peer_id(self) -> str:
        return self.host.get_id().to_string()

    def addrs(self) -> list[str]:
        """Addresses other nodes can dial, each ending in /p2p/<our id>."""
        if self.config.announce:
            return [a if "/p2p/" in a else f"{a}/p2p/{self.peer_id}" for a in self.config.announce]
        return dialable_addrs(self.host)

    def hello(self) -> Hello:
        return Hello(self.network, PROTOCOL_VERSION, __version__, tuple(self.addrs()))

    @asynccontextmanager
    async def running(self) -> AsyncIterator[P2PNode]:
        """Listen, start every service, yield once all are up; on exit close every peer.

        py-libp2p does not close connections when the host stops (STACK.md), so a
        departing node closes them itself: peers see the stream end at once instead of
        waiting out a liveness timeout.
        """
        async with self.host.run([multiaddr.Multiaddr(a) for a in self.listen]):
            # The swarm's auto-connector redials the whole peerstore toward a target
            # between its watermarks; whom we dial is the dialer's decision alone.
            await self.host.get_network().auto_connector.stop()
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.gossip.run)
                    await nursery.start(self.liveness.run)
                    await nursery.start(self.exchange.run)
                    await nursery.start(self.dialer.keep_bootstrapped, self.config.bootstrap,
                                        self.peers.known())
                    yield self
                    nursery.cancel_scope.cancel()
            finally:
                with trio.move_on_after(3) as scope:
                    scope.shield = True
                    await self.close_all()

    async def close_all(self) -> None:
        network = self.host.get_network()
        for pid in list(self.host.get_connected_peers()):
            try:
                await network.close_peer(pid)
            except Exception as exc:  # noqa: BLE001
                log.debug("close_peer failed on shutdown", peer=pid.to_string(), error=repr(exc))
