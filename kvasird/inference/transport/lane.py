"""Lanes: a direct TCP connection for one peer's stage or expert traffic, keyed over libp2p.

py-libp2p costs several times more Python per request round trip than a TCP socket sealed
with ChaCha20-Poly1305 (yamux, Noise and stream plumbing; bench/bench_link.py measures
both, across two processes on loopback). A generation pays it on every hop of every
token, so once a caller
has a libp2p channel to a peer it asks for a lane and moves the hot path onto it:

    caller (Channels)                                 server (LaneServer)
    ── libp2p channel: LaneAsk {op: "lane"} ───────▶  offer(): ticket = (token, key) bound to
    ◀─ LaneOffer {port, token, key} ─────────────────  the caller's peer id and protocol, 30 s
    TCP connect (the libp2p peer's IP, port) ── token ─▶ take the ticket (once)
    ◀─ sealed "ok" ─────────────────────────────────  proves the server holds the key
    Channel over SealedStream ◀── sealed frames ──▶   serve(the protocol's handler, caller)

The key travels inside the Noise session of the authenticated libp2p stream, so a lane is
as private as that stream and bound to the same peer id: the server knows who is calling
because only that peer received the token, and the caller knows it reached that server
because the "ok" opens with the key. Records carry per-direction counters as nonces, so a
replayed, reordered, forged or truncated record ends the lane.

A record is one frame, read whole before the frame reader sees it: the server's limits on
a caller it does not work for (rpc.Intake) apply to the record's length, before its
body is read (``SealedStream.check``).

Lanes are an optimisation, never a requirement: when the offer is refused, the TCP connect
fails or times out (NAT, a relayed peer, lanes off on either side) the caller keeps the
libp2p channel and asks again later (LANE_RETRY_S: after seconds, then less and less often).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from kvasird.errors import WireError
from kvasird.logs import get_logger
from kvasird.ports import listen_error
from kvasird.wire import FrameTooLarge, schema
from kvasird.wire.protocols import OP

TICKET_S = 30.0
"""An offered ticket must be used within this time."""
TICKETS_PER_PEER = 8
"""Outstanding tickets one peer may hold (a peer asking for more loses its oldest)."""
HELLO_S = 5.0
"""A TCP connection must present its token within this time."""
LANE_RETRY_S = (2.0, 300.0)
"""After a failed lane the caller stays on libp2p the first time before asking again,
doubling after each failure up to the second: a lane lost to a passing failure (two peers
dialling each other at start-up) comes back in seconds, a peer that never offers one is
asked every five minutes."""
TOKEN_BYTES = 16
WRITE_S = 10.0
"""Longest a record may take to go out when the caller gives no time (then the lane ends)."""
QUICK_RUN = 8
"""Records read or written without waiting, in a row, before the lane lets other tasks run."""
_LEN = struct.Struct(">I")
_SEALED = 16
"""What sealing adds to a record (the Poly1305 tag)."""
_OK = b"kvasir-lane-ok"
TCP_RTO_MIN_US = 45
"""Linux's per-socket floor of the retransmission timeout (6.15 and later; no privilege)."""
RTO_MIN_US = 10_000
"""A lane's floor: a lost packet of a one-packet step is resent after about 1.5 round trips
instead of the kernel's 200 ms floor (bench/bench_loss.py: at 20 ms and 1 % loss, p99 of a
hop's round trip 103 ms against 289 ms)."""
_TCP_IP = re.compile(r"^/ip[46]/([^/]+)/tcp/")
log = get_logger("kvasird.inference.transport.lane")

Serve = Callable[..., Any]
"""serve(sealed stream, peer=caller peer id) -> awaitable serving the protocol until it ends."""


@dataclass(frozen=True)
class LaneAsk:
    """May I have a lane to this protocol? (asked over its libp2p channel)"""

    TYPE = "lane"
    """Its type on the wire: a channel's server answers it before the protocol's own parse."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: self.TYPE}

    @staticmethod
    def from_wire(value: Any) -> LaneAsk:
        if schema.mapping(value, "lane").get(OP) != LaneAsk.TYPE:
            raise WireError(f"lane.{OP}: expected {LaneAsk.TYPE!r}")
        return LaneAsk()


@dataclass(frozen=True)
class LaneOffer:
    """A ticket for one lane: where to connect, and the secret that opens it."""

    port: int
    """The lane server's TCP port (on the IP of the caller's libp2p connection)."""
    token: bytes
    """Presented first on the TCP connection; good once, for TICKET_S."""
    key: bytes
    """The ChaCha20-Poly1305 key of the lane's records."""

    def to_wire(self) -> dict[str, Any]:
        return {"port": self.port, "token": self.token, "key": self.key}

    @staticmethod
    def from_wire(value: Any) -> LaneOffer:
        d = schema.mapping(value, "lane offer")
        token, key = d.get("token"), d.get("key")
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            raise WireError(f"lane offer.token: expected {TOKEN_BYTES} bytes")
        if not isinstance(key, bytes) or len(key) != 32:
            raise WireError("lane offer.key: expected 32 bytes")
        return LaneOffer(schema.integer(d, "port", 1, 65535, "lane offer"), token, key)


class SealedStream:
    """A TCP stream carrying ChaCha20-Poly1305 records: what framing needs (read/write).

    Every record goes out whole or the lane ends: a record cut short would make every later
    one unreadable. On a socket (POSIX), a write the kernel takes at once and a read of
    bytes already there go straight to the file descriptor without a pass through trio's
    scheduler; a step's record is a few KB, so that is nearly every one of them (a ring
    link between processes gets faster by about a quarter: bench/bench_link.py). After a
    few records in a row that did not wait the stream
    lets other tasks run, so a busy lane cannot starve its process.
    """

    whole_records = True
    """Each frame is one record, sent whole within its own deadline (``write``'s wait_s):
    an rpc Channel writes it without a lock of its own (kvasird.wire.rpc)."""

    def __init__(
        self, stream: trio.abc.Stream, key: bytes, initiator: bool, max_record: int
    ) -> None:
        self._stream = stream
        self._aead = ChaCha20Poly1305(key)
        self._out_dir, self._in_dir = (
            (b"\x00\x00\x00\x00", b"\x01\x00\x00\x00")
            if initiator
            else (b"\x01\x00\x00\x00", b"\x00\x00\x00\x00")
        )
        self._sent = 0
        self._received = 0
        self._max = max_record + 16
        self._raw = bytearray()
        self._plain = bytearray()
        self._send_lock = trio.Lock()
        self._socket = (
            stream.socket if isinstance(stream, trio.SocketStream) and os.name == "posix" else None
        )
        self._broken = False
        self._quick = 0
        self.check: Callable[[int], None] | None = None
        """What the frame a record carries must pass, given its length, before the record's
        body is read (raising to refuse it: the server's rpc.Intake)."""

    async def write(self, data: bytes, wait_s: float = WRITE_S) -> None:
        """Send `data` as one record, whole within `wait_s` (or the lane ends)."""
        if self._broken:
            raise trio.BrokenResourceError("the lane ended (a record could not be sent whole)")
        if self._socket is None or self._send_lock.locked():
            with trio.fail_after(wait_s):
                await self._send_lock.acquire()
            try:  # the counter must follow the order records go out
                await self._send_whole(self._seal(data), wait_s)
            finally:
                self._send_lock.release()
            return
        self._send_lock.acquire_nowait()
        try:
            record = self._seal(data)
            try:
                sent = os.write(self._socket.fileno(), record)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._broken = True
                raise trio.BrokenResourceError(f"lane write failed: {exc!r}") from None
            if sent < len(record):
                await self._send_whole(memoryview(record)[sent:], wait_s)
        finally:
            self._send_lock.release()
        await self._fair()

    def _seal(self, data: bytes) -> bytes:
        nonce = self._out_dir + self._sent.to_bytes(8, "little")
        self._sent += 1
        sealed = self._aead.encrypt(nonce, bytes(data), None)
        return _LEN.pack(len(sealed)) + sealed

    async def _send_whole(self, data: bytes | memoryview, wait_s: float) -> None:
        """The rest of a record, shielded from cancellation (the caller may give up; the
        record still goes whole) but within `wait_s`."""
        with trio.CancelScope(shield=True, deadline=trio.current_time() + wait_s) as sending:
            try:
                await self._stream.send_all(data)
            except BaseException:
                self._broken = True
                raise
        if sending.cancelled_caught:
            self._broken = True
            raise trio.BrokenResourceError(f"a lane record was not sent within {wait_s:g} s")

    async def _fair(self) -> None:
        """A pass through the scheduler after a few records read or written without waiting
        (shielded: what was sent or read stays done)."""
        self._quick += 1
        if self._quick >= QUICK_RUN:
            self._quick = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def read(self, n: int | None = None) -> bytes:
        if not self._plain:
            record = await self._record()
            if record is None:
                return b""
            self._plain += record
        n = len(self._plain) if n is None else min(n, len(self._plain))
        out = bytes(self._plain[:n])
        del self._plain[:n]
        return out

    async def _record(self) -> bytes | None:
        if not await self._fill(_LEN.size):
            return None
        (length,) = _LEN.unpack_from(self._raw)
        if length > self._max or length < 16:
            raise WireError(f"lane record of {length} bytes is outside 16..{self._max}")
        if self.check is not None:
            try:
                self.check(length - _SEALED - _LEN.size)
            except FrameTooLarge:
                del self._raw[: _LEN.size]
                await self._skip(length)  # the sender, writing it whole, then reads why
                raise
        if not await self._fill(_LEN.size + length):
            raise WireError("lane closed in the middle of a record")
        sealed = bytes(self._raw[_LEN.size : _LEN.size + length])
        del self._raw[: _LEN.size + length]
        nonce = self._in_dir + self._received.to_bytes(8, "little")
        self._received += 1
        try:
            record = self._aead.decrypt(nonce, sealed, None)
        except InvalidTag:
            raise WireError(
                "lane record failed authentication (forged, replayed or "
                "reordered): closing the lane"
            ) from None
        await self._fair()
        return record

    async def _skip(self, n: int) -> None:
        """Read and drop `n` bytes of records (one refused unread), a chunk at a time."""
        while n:
            if not self._raw and not await self._fill(1):
                raise WireError("lane closed in the middle of a record")
            dropped = min(n, len(self._raw))
            del self._raw[:dropped]
            n -= dropped

    async def _fill(self, n: int) -> bool:
        while len(self._raw) < n:
            size = max(65536, n - len(self._raw))
            if self._socket is None:
                chunk = await self._stream.receive_some(size)
            else:
                try:
                    chunk = os.read(self._socket.fileno(), size)
                except BlockingIOError:
                    self._quick = 0
                    await trio.lowlevel.wait_readable(self._socket)
                    continue
                except OSError as exc:
                    raise trio.BrokenResourceError(f"lane read failed: {exc!r}") from None
            if not chunk:
                return False
            self._raw += chunk
        return True

    async def reset(self) -> None:
        await self._stream.aclose()

    async def close(self) -> None:
        await self._stream.aclose()


class LaneServer:
    """Listens for lanes and hands each one to the protocol its ticket was offered for."""

    def __init__(
        self, host: str, port: int, max_record: int, config_path: str = "kvasird.toml"
    ) -> None:
        self.host, self.port, self.max_record = host, port, max_record
        self.config_path = config_path
        self._serve: dict[str, Serve] = {}
        self._tickets: dict[bytes, tuple[str, str, bytes, float]] = {}
        self.lanes = 0
        """Lanes accepted so far (status and tests)."""
        self.refused = 0
        """Connections that did not present a valid ticket."""

    def register(self, protocol: str, serve: Serve) -> None:
        self._serve[protocol] = serve

    async def run(
        self, *, task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve lanes until cancelled; started once listening, with the listeners."""
        try:
            listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        except OSError as exc:
            raise listen_error(
                "[inference] lane_port", self.host, self.port, exc, self.config_path
            ) from None
        self.port = listeners[0].socket.getsockname()[1]
        log.info("lanes listening", host=self.host, port=self.port)
        await trio.serve_listeners(self._accept, listeners, task_status=task_status)

    def offer(self, peer: str, protocol: str) -> LaneOffer:
        """A ticket for `peer` to open a lane for `protocol` (sent over its libp2p channel)."""
        if protocol not in self._serve or not self.port:
            raise WireError(f"no lanes for {protocol} here")
        now = trio.current_time()
        self._tickets = {t: v for t, v in self._tickets.items() if v[3] > now}
        mine = sorted((v[3], t) for t, v in self._tickets.items() if v[0] == peer)
        for _, token in mine[: max(0, len(mine) - TICKETS_PER_PEER + 1)]:
            del self._tickets[token]
        token, key = secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(32)
        self._tickets[token] = (peer, protocol, key, now + TICKET_S)
        return LaneOffer(self.port, token, key)

    async def _accept(self, stream: trio.SocketStream) -> None:
        quick_retransmit(stream)
        try:
            with trio.fail_after(HELLO_S):
                token = b""
                while len(token) < TOKEN_BYTES:
                    chunk = await stream.receive_some(TOKEN_BYTES - len(token))
                    if not chunk:
                        break
                    token += chunk
            ticket = self._tickets.pop(token, None)
            if ticket is None or ticket[3] < trio.current_time():
                self.refused += 1
                return
            peer, protocol, key, _ = ticket
            sealed = SealedStream(stream, key, initiator=False, max_record=self.max_record)
            await sealed.write(_OK)
            self.lanes += 1
            await self._serve[protocol](sealed, peer=peer)
        except Exception as exc:  # noqa: BLE001 - one lane's end never stops the listener
            log.debug("lane ended", reason=repr(exc))
        finally:
            await stream.aclose()


def quick_retransmit(stream: trio.SocketStream) -> None:
    """Lower the lane's retransmission timeout floor to RTO_MIN_US where the kernel can
    (an older one keeps its own: the lane works the same, a lost packet costs more)."""
    with contextlib.suppress(OSError):
        stream.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, RTO_MIN_US)


def tcp_ip(addr: str) -> str | None:
    """The IP of a TCP multiaddr (/ip4 or /ip6 .../tcp/...), where lanes are listened for
    and dialled; None for any other address."""
    m = _TCP_IP.match(addr)
    return m.group(1) if m else None


async def connect(ip: str, offer: LaneOffer, max_record: int, timeout_s: float) -> SealedStream:
    """Open the lane `offer` (the server's reply to LaneAsk) describes; raise on any failure."""
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream(ip, offer.port)
        quick_retransmit(stream)
        try:
            await stream.send_all(offer.token)
            sealed = SealedStream(stream, offer.key, initiator=True, max_record=max_record)
            if await sealed.read(len(_OK)) != _OK:
                raise WireError("lane: the server did not confirm the ticket")
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
    return sealed
