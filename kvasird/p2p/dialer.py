"""Whom to dial, and when: bootstrap peers (forever, with backoff), known peers, and
peers learned by exchange (once each, with backoff after failures).

Every dial has a timeout: a dial that hangs must not hold anything else up. A bootstrap
peer that cannot be reached is one warning with the reason in words and what to check,
repeated with a backoff of its own while it stays unreachable; libp2p's own lines for
each try are debug (kvasird.logs).
"""

from __future__ import annotations

import random

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.peerinfo import PeerInfo as Libp2pPeerInfo
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.exceptions import HandshakeFailure
from libp2p.transport.exceptions import SecurityUpgradeFailure

from kvasird.logs import get_logger

log = get_logger("kvasird.p2p.dialer")

DIAL_TIMEOUT_S = 5.0
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
WARN_AGAIN_MIN_S = 30.0
WARN_AGAIN_MAX_S = 600.0
"""A bootstrap peer that stays unreachable is warned about again after 30 s, then after
twice as long each time, up to every 10 minutes."""


def peer_id_of(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[-1]


def why_failed(exc: BaseException, addrs: list[str]) -> str:
    """A failed dial in words, with what to check. py-libp2p wraps the cause of each
    address's failure several levels deep (MultiError, __cause__, exception groups)."""
    where = ", ".join(a.rsplit("/p2p/", 1)[0] for a in addrs)
    causes = _causes(exc)
    if any(isinstance(c, (HandshakeFailure, SecurityUpgradeFailure)) for c in causes):
        return (
            f"the node at {where} answered, but the peer id did not match "
            f"{peer_id_of(addrs[0])} (or it uses another [p2p] psk_file): copy its join "
            "address again from its banner or `kvasird id`"
        )
    if any(isinstance(c, ConnectionRefusedError) for c in causes):
        return (
            f"connection refused at {where}: check that kvasird runs there and that the "
            "port is the one in its banner's join address"
        )
    if errors := [c for c in causes if isinstance(c, OSError)]:
        return (
            f"cannot connect to {where} ({errors[-1]}): check the address, and that no "
            "firewall blocks its port"
        )
    return f"{str(exc)[:200]} (address {where})"


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it wraps, outermost first."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e in seen:
            continue
        seen.append(e)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += [c for c in getattr(e, "errors", ()) if isinstance(c, BaseException)]
        todo += [c for c in getattr(e, "exceptions", ()) if isinstance(c, BaseException)]
    return seen


class Dialer:
    def __init__(self, host: IHost, max_peers: int) -> None:
        self._host = host
        self._max_peers = max_peers
        self._backoff: dict[str, tuple[float, float]] = {}  # peer id -> (next try, delay)
        self._self_id = host.get_id().to_string()
        self.failures: dict[str, str] = {}
        """Why the last dial of each peer failed, in words (cleared once one works)."""
        self._bootstrap: dict[str, list[str]] = {}
        """Bootstrap peers kept connected: peer id -> its addresses."""
        self._warned: dict[str, tuple[float, float]] = {}  # peer id -> (next warning, gap)

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
        # py-libp2p dials one address per transport of all it holds for the peer, so an
        # address tried before (a wrong port) would hide the one asked for now.
        self._host.get_peerstore().clear_addrs(info.peer_id)
        ok, error = (
            False,
            (
                f"no answer within {DIAL_TIMEOUT_S:g} s from "
                f"{', '.join(addrs)}: check the address and the firewall"
            ),
        )
        with trio.move_on_after(DIAL_TIMEOUT_S):
            try:
                await self._host.connect(info)
                ok = True
            except Exception as exc:  # noqa: BLE001 - the swarm raises a zoo of types
                error = why_failed(exc, addrs)
        if ok:
            self._backoff.pop(pid, None)
            self.failures.pop(pid, None)
            self._warned.pop(pid, None)
        else:
            self.failures[pid] = error
            log.debug("dial failed", peer=pid, error=error)
            _, delay = self._backoff.get(pid, (0.0, BACKOFF_MIN_S / 2))
            delay = min(delay * 2, BACKOFF_MAX_S)
            self._backoff[pid] = (trio.current_time() + delay * random.uniform(0.8, 1.2), delay)
        return ok

    async def keep_bootstrapped(
        self,
        bootstrap: tuple[str, ...],
        known: list[tuple[str, tuple[str, ...]]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Dial known peers once, and keep every bootstrap peer connected, with backoff."""
        for addr in bootstrap:
            self.add_bootstrap(addr)
        task_status.started()
        async with trio.open_nursery() as nursery:
            for _, addrs in known[: self._max_peers]:
                if addrs and peer_id_of(addrs[0]) not in self._bootstrap:
                    nursery.start_soon(self.dial, list(addrs))
            while True:
                for pid, boot_addrs in list(self._bootstrap.items()):
                    if not self.connected(pid) and self.due(pid):
                        nursery.start_soon(self._dial_bootstrap, list(boot_addrs))
                await trio.sleep(1.0)

    def add_bootstrap(self, addr: str) -> None:
        """Keep ``addr``'s peer connected from now on (``kvasird bootstrap add`` on a
        running daemon adds to the list it started with)."""
        addrs = self._bootstrap.setdefault(peer_id_of(addr), [])
        if addr not in addrs:
            addrs.append(addr)

    async def _dial_bootstrap(self, addrs: list[str]) -> None:
        """Dial a bootstrap peer; a failure is a warning, again only after a growing gap.
        After a failure its addresses rotate: py-libp2p tries one address per transport,
        the first, so each of several TCP addresses gets its turn."""
        pid = peer_id_of(addrs[0])
        if await self.dial(addrs) or pid not in self.failures:
            return
        kept = self._bootstrap[pid]
        kept.append(kept.pop(0))
        now = trio.current_time()
        at, gap = self._warned.get(pid, (now, WARN_AGAIN_MIN_S / 2))
        if now >= at:
            log.warning(
                f"cannot reach bootstrap peer {pid}: {self.failures[pid]}", peer=pid, addrs=addrs
            )
            gap = min(gap * 2, WARN_AGAIN_MAX_S)
            self._warned[pid] = (now + gap, gap)
