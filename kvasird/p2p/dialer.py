"""Whom to dial, and when: bootstrap peers (forever, with backoff), known peers, and
peers learned by exchange (once each, with backoff after failures).

Every dial has a timeout: a dial that hangs must not hold anything else up.
"""

from __future__ import annotations

import random

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.peerinfo import PeerInfo as Libp2pPeerInfo
from libp2p.peer.peerinfo import info_from_p2p_addr

from kvasird.logs import get_logger

log = get_logger("kvasird.p2p.dialer")

DIAL_TIMEOUT_S = 5.0
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0


def peer_id_of(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[-1]


class Dialer:
    def __init__(self, host: IHost, max_peers: int) -> None:
        self._host = host
        self._max_peers = max_peers
        self._backoff: dict[str, tuple[float, float]] = {}  # peer id -> (next try, delay)
        self._self_id = host.get_id().to_string()

    def connected(self, peer_id: str) -> bool:
        return any(p.to_string() == peer_id for p in self._host.get_connected_peers())

    def room(self) -> bool:
        return len(self._host.get_connected_peers()) < self._max_peers

    def due(self, peer_id: str) -> bool:
        return self._backoff.get(peer_id, (0.0, 0.0))[0] <= trio.current_time()

    async def dial(self, addrs: list[str]) -> bool:
        """Dial one peer by its addresses (all with the same /p2p/ id). True on success."""
        if not addrs:
            return False
        pid = peer_id_of(addrs[0])
        if pid == self._self_id or self.connected(pid):
            return pid != self._self_id
        try:
            infos = [info_from_p2p_addr(multiaddr.Multiaddr(a)) for a in addrs]
        except Exception as exc:  # noqa: BLE001 - bad addresses from config or peers
            log.warning("cannot dial: bad address", addrs=addrs, error=str(exc))
            return False
        info = Libp2pPeerInfo(infos[0].peer_id, [a for i in infos for a in i.addrs])
        ok, error = False, f"no connection within {DIAL_TIMEOUT_S:g} s"
        with trio.move_on_after(DIAL_TIMEOUT_S):
            try:
                await self._host.connect(info)
                ok = True
            except Exception as exc:  # noqa: BLE001 - the swarm raises a zoo of types
                error = str(exc)[:200]
        if ok:
            self._backoff.pop(pid, None)
        else:
            log.debug("dial failed", peer=pid, error=error)
            _, delay = self._backoff.get(pid, (0.0, BACKOFF_MIN_S / 2))
            delay = min(delay * 2, BACKOFF_MAX_S)
            self._backoff[pid] = (trio.current_time() + delay * random.uniform(0.8, 1.2), delay)
        return ok

    async def keep_bootstrapped(self, bootstrap: tuple[str, ...], known: list[tuple[str, tuple[str, ...]]],
                                *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Dial known peers once, and keep every bootstrap peer connected, with backoff."""
        groups: dict[str, list[str]] = {}
        for addr in bootstrap:
            groups.setdefault(peer_id_of(addr), []).append(addr)
        task_status.started()
        async with trio.open_nursery() as nursery:
            for _, addrs in known[: self._max_peers]:
                if addrs and peer_id_of(addrs[0]) not in groups:
                    nursery.start_soon(self.dial, list(addrs))
            while True:
                for pid, addrs in groups.items():
                    if not self.connected(pid) and self.due(pid):
                        nursery.start_soon(self.dial, addrs)
                await trio.sleep(1.0)
