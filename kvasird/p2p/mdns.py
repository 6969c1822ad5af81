"""LAN discovery by multicast DNS (py-libp2p's mDNS, on zeroconf).

Nodes of one network on one LAN find each other without a bootstrap list: each
announces its TCP addresses under a service type derived from the network name and
the pre-shared key, so nodes of other networks (or without the key) never even see
each other's announcements. Found peers are handed to the dialer, and the hello
decides as for any other peer.

zeroconf reports from its own thread; reports cross into trio through the trio
token and a bounded channel (a flood of announcements is dropped, not queued).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.discovery.mdns.mdns import create_mdns_discovery

from kvasird.logs import get_logger
from kvasird.p2p.dialer import Dialer

_QUEUE = 64
log = get_logger("kvasird.p2p.mdns")


def service_tag(network: str, psk: str | None) -> str:
    """10 hex digits naming (network, key): DNS-SD service labels allow 15 bytes."""
    return hashlib.sha256(f"kvasir/{network}/{psk or ''}".encode()).hexdigest()[:10]


class LanDiscovery:
    def __init__(
        self,
        host: IHost,
        dialer: Dialer,
        network: str,
        psk: str | None,
        addrs: Callable[[], list[str]],
    ) -> None:
        self._host = host
        self._dialer = dialer
        self._tag = service_tag(network, psk)
        self._addrs = addrs
        self.found = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        token = trio.lowlevel.current_trio_token()
        send, receive = trio.open_memory_channel[list[str]](_QUEUE)
        me = self._host.get_id()

        def offer(addrs: list[str]) -> None:
            with contextlib.suppress(trio.WouldBlock):  # a flood is dropped, not queued
                send.send_nowait(addrs)

        def discovered(info: Any) -> None:  # runs in zeroconf's thread
            if info.peer_id == me:
                return
            pid = info.peer_id.to_string()
            addrs = [f"{a}/p2p/{pid}" if "/p2p/" not in str(a) else str(a) for a in info.addrs]
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(offer, addrs)

        # Our dialable addresses, not the host's listen addresses: those may be 0.0.0.0,
        # which a peer would dial as its own machine. (The library filters out /ws and
        # /p2p-circuit addresses itself.)
        announce = self._addrs()
        port = next((int(a.split("/")[4]) for a in announce if a.split("/")[3:4] == ["tcp"]), 0)
        try:
            mdns = create_mdns_discovery(
                self._host.get_network(),
                port=port,
                listen_addrs=announce,
                private_network_fingerprint=self._tag,
            )
        except OSError as exc:
            log.warning(
                "mDNS is unavailable (UDP port 5353 cannot be used): LAN peers will not "
                "be found automatically; set [p2p] mdns = false to silence this",
                error=str(exc),
            )
            task_status.started()
            return
        peerDiscovery.register_peer_discovered_handler(discovered)
        try:
            mdns.start()
            task_status.started()
            async for addrs in receive:
                self.found += 1
                pid = addrs[0].rsplit("/p2p/", 1)[-1] if addrs else ""
                if pid and self._dialer.room() and self._dialer.due(pid):
                    await self._dialer.dial(addrs)
        finally:
            peerDiscovery.unregister_peer_discovered_handler(discovered)
            mdns.stop()
