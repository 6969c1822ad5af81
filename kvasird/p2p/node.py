"""P2PNode: the host and its services in one nursery, started in order."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import multiaddr
import trio
from libp2p.network.swarm import Swarm

from kvasird import PROTOCOL_VERSION, __version__
from kvasird.config import P2PConfig
from kvasird.errors import ConfigError
from kvasird.identity import NodeKey
from kvasird.logs import get_logger
from kvasird.p2p.dht import PeerRouting
from kvasird.p2p.exchange import PeerExchange
from kvasird.p2p.gossip import Gossip
from kvasird.p2p.hello import MAX_ADDRS, Hello
from kvasird.p2p.host import build_host, dialable_addrs, parse_listen
from kvasird.p2p.liveness import Liveness
from kvasird.p2p.mdns import LanDiscovery
from kvasird.p2p.peers import PeerTable
from kvasird.p2p.psk import fingerprint, load_psk
from kvasird.p2p.reachability import DialBack, Reachability
from kvasird.p2p.relay import AddressPush, CircuitDialer, Relays
from kvasird.ports import bind_exclusively, listen_error, multiaddr_tcp

log = get_logger("kvasird.p2p")


class P2PNode:
    def __init__(
        self,
        key: NodeKey,
        config: P2PConfig,
        network: str,
        db: sqlite3.Connection,
        config_path: str = "kvasird.toml",
    ) -> None:
        self.key = key
        self.config = config
        self.network = network
        self.config_path = config_path
        self.listen = parse_listen(config.listen)
        self.psk = load_psk(config.psk_file)
        self.host = build_host(key, self.listen, list(config.announce), config.max_peers, self.psk)
        self.peers = PeerTable(db)
        self.dialer = CircuitDialer(self.host, config.max_peers)
        self.push = AddressPush(self.host, self.peers, self.addrs, __version__)
        self.relays = Relays(
            self.host,
            self.peers,
            config.relay_service,
            config.relay_reservations,
            self.psk,
            self.push.changed,
        )
        self.dialer.relays = self.relays
        self.reachability = DialBack(
            self.host,
            self.peers,
            self.addrs,
            self.psk,
            config.reachability_interval_s,
            self._reachability_changed,
            config_path,
        )
        self.routing = (
            PeerRouting(self.host, self.peers, self.dialer, config.peer_exchange_interval_s)
            if config.dht
            else None
        )
        self.lan = (
            LanDiscovery(self.host, self.dialer, network, self.psk, self.addrs)
            if config.mdns
            else None
        )
        self.gossip = Gossip(self.host, network)
        self.liveness = Liveness(
            self.host,
            self.peers,
            self.hello,
            config.heartbeat_interval_s,
            config.liveness_timeout_s,
        )
        self.exchange = PeerExchange(
            self.host, self.peers, self.dialer, config.peer_exchange_interval_s
        )

    @property
    def peer_id(self) -> str:
        return self.host.get_id().to_string()

    def addrs(self) -> list[str]:
        """Addresses other nodes can dial, each ending in /p2p/<our id>; relay circuit
        addresses (while we hold reservations) last, always within the hello's limit."""
        if self.config.announce:
            direct = [
                a if "/p2p/" in a else f"{a}/p2p/{self.peer_id}" for a in self.config.announce
            ]
        else:
            direct = dialable_addrs(self.host)
        circuit = self.relays.circuit_addrs()[: MAX_ADDRS // 2]
        return direct[: MAX_ADDRS - len(circuit)] + circuit

    async def connect(self, peer_id: str, addrs: Sequence[str] = ()) -> bool:
        """Be connected to ``peer_id``: directly, else through one of its relays.

        For stream protocols that reach peers known from records: ``host.new_stream``
        dials only direct addresses, never circuit ones (STACK.md). Addresses come from
        ``addrs`` (e.g. a coverage record), else the peer table, else a DHT lookup.
        """
        if self.dialer.connected(peer_id):
            return True
        known = list(addrs) or list(getattr(self.peers.get(peer_id), "addrs", ()))
        if not known and self.routing is not None:
            known = await self.routing.find(peer_id)
        return bool(known) and await self.dialer.dial(known)

    def _reachability_changed(self, r: Reachability) -> None:
        self.relays.on_reachability(r)
        if self.routing is not None:
            self.routing.on_reachability(r)

    def reach_status(self) -> dict[str, object]:
        """Reachability, relays and discovery, for `kvasird status`."""
        return {
            **self.reachability.current.to_json(),
            "relay_service": self.relays.serving,
            "relays": sorted(self.relays.reservations),
            "circuit_addrs": self.relays.circuit_addrs(),
            "dht": self.routing.mode if self.routing is not None else "off",
            "mdns": self.lan is not None,
            "private_network": fingerprint(self.psk),
        }

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
            self._check_listening()
            # The swarm's auto-connector redials the whole peerstore toward a target
            # between its watermarks; whom we dial is the dialer's decision alone.
            swarm = self.host.get_network()
            assert isinstance(swarm, Swarm)  # build_host's network
            await swarm.auto_connector.stop()
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.gossip.run)
                    await nursery.start(self.liveness.run)
                    if self.config.peer_exchange:
                        await nursery.start(self.exchange.run)
                    await nursery.start(self.push.run)
                    await nursery.start(self.relays.run)
                    await nursery.start(self.reachability.run)
                    if self.routing is not None:
                        await nursery.start(self.routing.run)
                    if self.lan is not None:
                        await nursery.start(self.lan.run)
                    await nursery.start(
                        self.dialer.keep_bootstrapped, self.config.bootstrap, self.peers.known()
                    )
                    yield self
                    nursery.cancel_scope.cancel()
            finally:
                with trio.move_on_after(3) as scope:
                    scope.shield = True
                    await self.close_all()

    def _check_listening(self) -> None:
        """Raise a ConfigError naming [p2p] listen when an address is not listened on.

        py-libp2p logs a failed listen at debug level and runs on without it, so a taken
        port would leave the node unreachable at the address it announces.
        """
        listening = self.host.get_network().listeners
        for addr in self.listen:
            if str(multiaddr.Multiaddr(addr)) in listening:
                continue
            host, port = multiaddr_tcp(addr)
            if port:
                try:
                    bind_exclusively(host, port).close()
                except OSError as exc:
                    raise listen_error("[p2p] listen", host, port, exc, self.config_path) from None
            raise ConfigError(
                f"cannot listen on {addr}: set [p2p] listen in "
                f"{self.config_path} to an address of this machine"
            )

    async def close_all(self) -> None:
        network = self.host.get_network()
        for pid in list(self.host.get_connected_peers()):
            try:
                await network.close_peer(pid)
            except Exception as exc:  # noqa: BLE001
                log.debug("close_peer failed on shutdown", peer=pid.to_string(), error=repr(exc))
