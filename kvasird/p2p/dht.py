"""Peer routing on the Kademlia DHT (py-libp2p kad_dht): find peers by id, and find
peers beyond the bootstrap list.

    peer table (hello-checked peers) --addrs--> peerstore + routing table
    every discovery interval: lookup of a random key --> closest peers --> dialer

Only peers that passed the hello (same network, same protocol) are put into the
routing table. A publicly reachable node answers DHT queries (server mode); a private
one only asks (client mode), so no one wastes lookups on a node it cannot dial.
Until the first reachability verdict a node serves, as most freshly started nodes
with a bootstrap list are reachable by their bootstrap peer.

Every lookup runs under a timeout: a DHT query to a peer that died unnoticed would
otherwise wait forever (STACK.md).
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.tools.anyio_service import background_trio_service

from kvasird.logs import get_logger
from kvasird.p2p.dialer import Dialer
from kvasird.p2p.peers import PeerTable
from kvasird.p2p.reachability import Reachability, is_circuit

LOOKUP_TIMEOUT_S = 20.0
SYNC_EVERY_S = 1.0
ADDR_TTL_S = 3600
log = get_logger("kvasird.p2p.dht")
# kad_dht warns on every stream a peer closes mid-message (routine on shutdown and
# during lookups); its real failures are errors.
logging.getLogger("libp2p.kad_dht").setLevel(logging.ERROR)


def _with_id(addr: str, pid: str) -> str:
    return addr if addr.endswith(f"/p2p/{pid}") else f"{addr}/p2p/{pid}"


def _for_peerstore(addr: str, pid: str) -> multiaddr.Multiaddr:
    """Direct addresses without their /p2p/ suffix (as the swarm dials them); circuit
    addresses whole (the relay transport needs the destination id)."""
    if not is_circuit(addr) and addr.endswith(f"/p2p/{pid}"):
        addr = addr[: -len(f"/p2p/{pid}")]
    return multiaddr.Multiaddr(addr)


class PeerRouting:
    def __init__(self, host: IHost, peers: PeerTable, dialer: Dialer, interval_s: float) -> None:
        self._host = host
        self._peers = peers
        self._dialer = dialer
        self._interval = interval_s
        self.dht = KadDHT(host, DHTMode.SERVER)
        self._mode = self._wanted_mode = DHTMode.SERVER
        self.lookups = 0
        self._tried: dict[str, frozenset[str]] = {}

    @property
    def mode(self) -> str:
        return "server" if self._mode == DHTMode.SERVER else "client"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.dht), trio.open_nursery() as nursery:
            task_status.started()
            nursery.start_soon(self._discover)
            while True:
                await self._sync()
                await trio.sleep(SYNC_EVERY_S)

    def on_reachability(self, r: Reachability) -> None:
        """Serve when public, only ask when private (applied by the sync loop)."""
        self._wanted_mode = {"public": DHTMode.SERVER, "private": DHTMode.CLIENT}.get(
            r.verdict, self._wanted_mode
        )

    async def _sync(self) -> None:
        """Apply the wanted mode; put hello-checked peers into peerstore and routing table."""
        if self._wanted_mode != self._mode:
            self._mode = await self.dht.switch_mode(self._wanted_mode)
            log.info("DHT mode changed", mode=self.mode)
        store = self._host.get_peerstore()
        for p in self._peers.snapshot():
            if not p.addrs:
                continue
            pid = ID.from_base58(p.peer_id)
            store.add_addrs(pid, [_for_peerstore(a, p.peer_id) for a in p.addrs], ADDR_TTL_S)
            if not self.dht.routing_table.peer_in_table(pid):
                await self.dht.add_peer(pid)

    async def _discover(self) -> None:
        """Look up random keys and dial the peers found: bootstrap beyond the list."""
        while True:
            await trio.sleep(self._interval * random.uniform(0.5, 1.0))
            if len(self._peers) == 0:
                continue
            found = await self.closest(os.urandom(32))
            table = [p.to_string() for p in self.dht.routing_table.get_peer_ids()]
            async with trio.open_nursery() as nursery:
                for pid in dict.fromkeys(found + table):
                    addrs = self.addrs_of(pid)
                    if pid in self._peers or not addrs or not self._dialer.room():
                        continue
                    # New addresses (a private peer's fresh circuit ones) are worth a dial
                    # even while the old ones are backing off.
                    if self._dialer.due(pid) or self._tried.get(pid) != frozenset(addrs):
                        self._tried[pid] = frozenset(addrs)
                        nursery.start_soon(self._dialer.dial, addrs)

    async def closest(self, key: bytes) -> list[str]:
        """Peer ids closest to ``key`` found by an iterative lookup ([] on timeout)."""
        self.lookups += 1
        with trio.move_on_after(LOOKUP_TIMEOUT_S):
            try:
                ids = await self.dht.peer_routing.find_closest_peers_network(key)
                return [i.to_string() for i in ids if i != self._host.get_id()]
            except Exception as exc:  # noqa: BLE001 - the library raises many types
                log.debug("DHT lookup failed", error=repr(exc)[:200])
        return []

    def addrs_of(self, pid: str) -> list[str]:
        """Addresses of ``pid`` known to the peerstore, each ending in /p2p/<pid>."""
        try:
            addrs = self._host.get_peerstore().addrs(ID.from_base58(pid))
        except Exception:  # noqa: BLE001 - unknown peer
            return []
        return list(dict.fromkeys(_with_id(str(a), pid) for a in addrs))

    async def find(self, pid: str) -> list[str]:
        """Addresses of the peer ``pid`` by DHT lookup ([] when not found in time)."""
        with trio.move_on_after(LOOKUP_TIMEOUT_S):
            try:
                info: Any = await self.dht.find_peer(ID.from_base58(pid))
            except Exception as exc:  # noqa: BLE001
                log.debug("DHT find_peer failed", peer=pid, error=repr(exc)[:200])
                return []
            if info is not None:
                return list(dict.fromkeys(_with_id(str(a), pid) for a in info.addrs))
        return []
