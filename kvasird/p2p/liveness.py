"""Liveness: an application heartbeat, because py-libp2p never notices a dead peer.

A peer whose process dies stays "connected" in py-libp2p forever (STACK.md). So each
node keeps one heartbeat stream to every connected peer:

    dialer  --hello-->  listener        (both directions: each side runs its own client)
            <--hello--
            --ping n--> / <--pong n--   every heartbeat_interval_s

A peer that has not answered for liveness_timeout_s is closed and dropped from the
peer table. So the bound on noticing a dead peer is liveness_timeout_s plus at most
one heartbeat interval. Silence is measured on trio's clock (not the wall clock the peer
table shows): a clock step does not drop every peer at once, and a test's MockClock
drives it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from kvasird.errors import WireError
from kvasird.logs import get_logger
from kvasird.p2p.hello import Hello
from kvasird.p2p.messages import Ping, Pong
from kvasird.p2p.peers import PeerTable
from kvasird.p2p.streams import served
from kvasird.wire import FrameReader, write_frame
from kvasird.wire.protocols import HEARTBEAT_PROTOCOL

_MAX_FRAME = 16 * 1024
log = get_logger("kvasird.p2p.liveness")


class Liveness:
    def __init__(
        self,
        host: IHost,
        peers: PeerTable,
        hello: Callable[[], Hello],
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self._host = host
        self._peers = peers
        self._hello = hello
        self._interval = interval_s
        self._timeout = timeout_s
        self._tracked: set[str] = set()
        self._heard: dict[str, float] = {}
        """Tracked peer -> when it was last heard from (trio time): hello, ping or pong."""
        self._closing: set[str] = set()
        self._nursery: trio.Nursery

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._host.set_stream_handler(HEARTBEAT_PROTOCOL, self._serve)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                for pid in self._host.get_connected_peers():
                    key = pid.to_string()
                    if key not in self._tracked and key not in self._closing:
                        self._tracked.add(key)
                        self._heard[key] = trio.current_time()
                        self._peers.connected(key)
                        nursery.start_soon(self._watch, pid)
                await trio.sleep(min(self._interval, 1.0))

    async def _watch(self, pid: ID) -> None:
        """Drop the peer when its heartbeat fails or it is silent past the timeout.

        The heartbeat I/O runs in its own task: py-libp2p has shielded cleanup paths that
        can block on a dead connection, so the decision to drop a peer is made here, on
        the clock alone, and never waits for a libp2p call to return.
        """
        key = pid.to_string()
        io_scope = trio.CancelScope()
        ended = trio.Event()
        reason = ["node stopping"]

        async def io() -> None:
            with io_scope:
                reason[0] = await self._heartbeat(pid)
            ended.set()

        self._nursery.start_soon(io)
        try:
            while not ended.is_set():
                with trio.move_on_after(self._interval):
                    await ended.wait()
                if not ended.is_set() and self._silent_s(key) > self._timeout:
                    reason[0] = f"silent for more than {self._timeout:g} s"
                    break
        finally:
            io_scope.cancel()
            silent_s = self._silent_s(key)
            self._tracked.discard(key)
            self._heard.pop(key, None)
            gone = self._peers.dropped(key)
            if gone is not None and reason[0] != "node stopping":
                log.info("peer dropped", peer=key, reason=reason[0], silent_s=round(silent_s, 1))
                self._closing.add(key)
                self._nursery.start_soon(self._close, pid)

    async def _close(self, pid: ID) -> None:
        try:
            await self._host.get_network().close_peer(pid)
        except Exception as exc:  # noqa: BLE001 - closing a dead connection may fail any way
            log.debug("close_peer failed", peer=pid.to_string(), error=repr(exc))
        finally:
            self._closing.discard(pid.to_string())

    async def _heartbeat(self, pid: ID) -> str:
        """Run the heartbeat client until the peer fails; return why it was dropped."""
        key = pid.to_string()
        try:
            with trio.fail_after(self._timeout):
                stream = await self._host.new_stream(pid, [HEARTBEAT_PROTOCOL])
                reader = FrameReader(stream, _MAX_FRAME)
                await write_frame(stream, self._hello().to_wire())
                their = Hello.from_wire(await reader.read(), key)
        except trio.TooSlowError:
            return f"no hello within {self._timeout:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure here means "not reachable"
            return f"heartbeat stream failed: {exc!r}"
        if reason := self._check(key, their):
            return reason
        self._heard_from(key)
        self._peers.hello(key, their.addrs, their.version)
        for n in itertools.count(1):
            await trio.sleep(self._interval)
            sent = trio.current_time()
            # Heard from in either direction counts: the peer's own pings refresh it.
            left = self._timeout - self._silent_s(key)
            try:
                with trio.fail_after(max(left, 0.1)):
                    await write_frame(stream, Ping(n).to_wire())
                    while _pong(await reader.read(), key) != n:
                        pass
            except trio.TooSlowError:
                return f"no heartbeat answer for {self._timeout:g} s"
            except Exception as exc:  # noqa: BLE001
                return f"heartbeat failed: {exc!r}"
            self._heard_from(key)
            self._peers.seen(key, rtt_ms=(trio.current_time() - sent) * 1000)
        raise AssertionError("unreachable")

    def _heard_from(self, key: str) -> None:
        if key in self._tracked:  # as the peer table, which holds watched peers only
            self._heard[key] = trio.current_time()

    def _silent_s(self, key: str) -> float:
        return trio.current_time() - self._heard.get(key, float("-inf"))

    def _check(self, key: str, their: Hello) -> str:
        ours = self._hello()
        if their.network != ours.network:
            log.warning(
                "peer is on another network", peer=key, theirs=their.network, ours=ours.network
            )
            return f"peer is on network {their.network!r}, we are on {ours.network!r}"
        if their.protocol != ours.protocol:
            log.warning(
                "peer speaks another wire protocol version",
                peer=key,
                theirs=their.protocol,
                ours=ours.protocol,
            )
            return f"peer speaks protocol {their.protocol}, we speak {ours.protocol}"
        return ""

    async def _serve(self, stream: INetStream) -> None:
        """Answer a peer's heartbeat stream; a silent peer is cut off after the timeout."""
        key = stream.muxed_conn.peer_id.to_string()
        reader = FrameReader(stream, _MAX_FRAME)
        async with served(stream, "heartbeat", key, reset=True):
            with trio.fail_after(self._timeout):
                their = Hello.from_wire(await reader.read(), key)
                await write_frame(stream, self._hello().to_wire())
            if self._check(key, their):
                return
            # Only the peer's watcher adds or removes table entries; this side just
            # refreshes last_seen, so a dropped peer cannot linger through its old stream.
            while True:
                with trio.fail_after(self._timeout + self._interval):
                    value = await reader.read()
                try:
                    ping = Ping.from_wire(value)
                except WireError as exc:  # not a ping: answered by nothing, the stream stays
                    log.debug("heartbeat frame ignored", peer=key, reason=str(exc))
                    continue
                self._heard_from(key)
                self._peers.seen(key)
                await write_frame(stream, Pong(ping.n).to_wire())


def _pong(value: object, peer: str) -> int | None:
    """The counter of `value` when it is a Pong; None (logged) for any other frame."""
    try:
        return Pong.from_wire(value).n
    except WireError as exc:
        log.debug("heartbeat frame ignored", peer=peer, reason=str(exc))
        return None
