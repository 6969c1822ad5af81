"""Request/response with ids over one long-lived libp2p stream per peer and protocol.

Opening a stream costs ~8 ms in py-libp2p (STACK.md), so a caller keeps one stream per
(peer, protocol) and multiplexes: every request carries an ``id``, the reply echoes it,
and a reader task hands each reply to its waiter. Every wait has a timeout, because a
dead peer is never noticed by py-libp2p: on a timeout or a broken stream the channel
is reset and dropped, and every request still waiting on it fails at once.

    Channels.request(peer, proto, msg) ──▶ Channel ──frame {id, op, ...}──▶ serve() ─parse─▶ handler
                                     ◀── reader task ◀──frame {id, ...}────┘  (one task per request)
    Channels.notify(peer, proto, msg)  ──▶ Channel ──frame {id: 0, op, ...}──▶ serve() (no answer)

serve() hands each frame to its protocol's parse as it is read (kvasird.inference.protocol),
so a handler only sees validated messages; a handler's Refusal becomes the reply {error,
code}, which request() raises as Refused (a code outside errors.CODES reads as "bad").

What a server reads from a peer depends on whether it works for that peer (Intake, asked
through the protocol server's own predicate): a peer with no session there sends only
small frames and has little in flight at once. A frame over its limit is refused from its
length prefix, its body never read: the server answers {id: 0, error, code} and ends the
stream, and the caller's channel fails every request waiting on it with that error.

One-way messages carry the stage-to-stage forwarding of a generation's steps (swarm.py):
whatever they lead to comes back as another message, from another peer. A short one the
protocol marks `inline` (a decode step computed in place) runs in the reader task itself.

Once a libp2p channel is open, Channels asks the peer for a lane (lane.py: a direct TCP
connection keyed over the channel, ~0.44 ms faster per round trip) in the background and
moves the peer's requests onto it when it is up; the libp2p channel stays the fallback.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from kvasird.errors import KvasirError, WireError
from kvasird.inference.errors import HopFailed, Refusal, Refused, Silent, Unreachable, code_of
from kvasird.inference.transport import lane
from kvasird.logs import get_logger
from kvasird.p2p.reachability import is_circuit
from kvasird.wire import FrameReader, FrameTooLarge, frame, write_frame
from kvasird.wire.framing import SKIP_CHUNK

MAX_FRAME = 64 << 20
"""Largest frame: a prefill's hidden states (512 tokens × 8192 × 4 B = 16 MiB) with room."""
SMALL_FRAME = 2 << 20
"""Largest frame from a peer the server does not work for yet (Intake): an open with the
page keys of a long prompt and the largest grammar (MAX_GRAMMAR_CHARS) fits."""
SMALL_IN_FLIGHT = 2 * SMALL_FRAME
"""Bytes of frames from such a peer being handled at once."""
IN_FLIGHT = 4 * MAX_FRAME
"""Bytes of frames from a peer the server works for being handled at once."""
LINGER_S = 2.0
"""How long a server keeps a stream it refused a frame on, for the caller to read why."""
OPEN_TIMEOUT_S = 5.0
LANE_OPEN_S = 2.0
"""Longest a lane may take to come up (offer, TCP connect, confirmation)."""
log = get_logger("kvasird.inference.transport.channel")

Handler = Callable[[str, Any], Awaitable[dict[str, Any]]]
"""(caller peer id, request: the frame as its protocol's parse made it) -> reply; raising
Refusal answers with its code, any other error with "bad"."""


class _Failures:
    """Every way a send or wait can fail, as the HopFailed that routes around the peer
    (a plain class: this wraps every frame sent, and contextlib's generators cost more)."""

    def __init__(self, peer: str, timed_out: str) -> None:
        self.peer, self.timed_out = peer, timed_out

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> bool:
        if exc is None or isinstance(exc, KvasirError):
            return False
        if isinstance(exc, trio.TooSlowError):
            raise Silent(self.peer, self.timed_out) from None
        if isinstance(exc, trio.EndOfChannel | trio.BrokenResourceError
                      | trio.ClosedResourceError):
            raise HopFailed(self.peer, "the stream broke") from None
        if isinstance(exc, Exception):  # libp2p stream errors come in many types
            raise HopFailed(self.peer, f"sending failed: {exc!r}") from None
        return False  # Cancelled, KeyboardInterrupt: not the peer's failure


class Intake:
    """What a server reads from each peer, by whether it works for it now (`admitted`: the
    protocol server's own predicate, such as a session held here; asked only when a peer
    goes past the small allowances, never on a decode step's few KB).

    A peer it does not work for sends frames of at most SMALL_FRAME and has at most
    SMALL_IN_FLIGHT bytes of frames being handled at once; one it works for, MAX_FRAME
    and IN_FLIGHT. A frame over the limit is refused from its length (``check``), before
    its body is read; one over the budget waits (its stream is not read meanwhile) until
    the peer's earlier frames are handled (``take``, ``give``), so a stranger's frames
    never hold more than a few MiB of this node's memory.
    """

    def __init__(self, admitted: Callable[[str], bool]) -> None:
        self.admitted = admitted
        self._held: dict[str, int] = {}
        """Peer -> bytes of its frames read and not yet handled."""
        self._freed = trio.Event()
        self._waiting = 0
        """Frames waiting for room (``give`` wakes them only then: it runs for every frame)."""

    def check(self, peer: str, length: int) -> None:
        """FrameTooLarge when `peer` may not send a frame of `length` bytes now."""
        if length > SMALL_FRAME and not self.admitted(peer):
            raise FrameTooLarge(length, SMALL_FRAME, " for a peer with no session here "
                                "(open a session, or have a request admitted, first)")

    async def take(self, peer: str, length: int) -> None:
        """Count a frame of `length` bytes (one ``check`` let through) in flight for `peer`,
        once its budget has room; a frame alone always fits."""
        while True:
            held = self._held.get(peer, 0)
            total = held + length
            if not held or total <= SMALL_IN_FLIGHT or \
                    total <= IN_FLIGHT and self.admitted(peer):
                self._held[peer] = total
                return
            self._waiting += 1
            try:
                await self._freed.wait()
            finally:
                self._waiting -= 1

    def give(self, peer: str, length: int) -> None:
        """A frame of `peer`'s is handled: its bytes are in flight no more."""
        left = self._held.pop(peer) - length
        if left:
            self._held[peer] = left
        if self._waiting:
            self._freed.set()
            self._freed = trio.Event()


class Channel:
    """One open stream to one peer, carrying many concurrent requests."""

    def __init__(self, peer: str, stream: INetStream | lane.SealedStream) -> None:
        self.peer = peer
        self.stream = stream
        self.closed = False
        self._reader = FrameReader(stream, MAX_FRAME)
        self._write = trio.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}

    async def request(self, msg: dict[str, Any], wait_s: float) -> dict[str, Any]:
        rid = next(self._ids)
        send, recv = trio.open_memory_channel[dict[str, Any]](1)
        self._waiting[rid] = send
        try:
            with _Failures(self.peer, f"no answer to {msg.get('op')!r} within {wait_s:g} s"), \
                    trio.fail_after(wait_s):
                await self._write_frame({**msg, "id": rid}, wait_s)
                reply = await recv.receive()
        finally:
            self._waiting.pop(rid, None)
        if "error" in reply:
            raise Refused(self.peer, code_of(reply.get("code")), str(reply["error"])[:500])
        return reply

    async def notify(self, msg: dict[str, Any], wait_s: float) -> None:
        """Send a one-way message (id 0: the peer answers nothing, not even an error)."""
        if self.closed:
            raise HopFailed(self.peer, "the stream broke")
        with _Failures(self.peer, f"could not send {msg.get('op')!r} within {wait_s:g} s"):
            await self._write_frame({**msg, "id": 0}, wait_s)

    async def _write_frame(self, value: dict[str, Any], wait_s: float) -> None:
        data = frame(value, MAX_FRAME)
        if isinstance(self.stream, lane.SealedStream):
            # one frame is one record, which the lane sends whole (or ends) within wait_s
            await self.stream.write(data, wait_s)
            return
        with trio.fail_after(wait_s):
            await self._write.acquire()
        try:
            # A frame cut short by a cancellation (a client that went away) would corrupt
            # every later frame on the stream: it is always written whole, within the
            # request's time, and a frame that cannot be ends the channel.
            with trio.CancelScope(shield=True,
                                  deadline=trio.current_time() + wait_s) as writing:
                await self.stream.write(data)
        finally:
            self._write.release()
        if writing.cancelled_caught:
            self.fail()
            raise trio.TooSlowError

    async def read_replies(self) -> None:
        try:
            while True:
                reply = await self._reader.read()
                rid = reply.get("id") if isinstance(reply, dict) else None
                if rid == 0 and "error" in reply:  # the peer ends the stream, saying why
                    self.closed = True  # what is asked from now on goes on a new stream
                    for waiter in list(self._waiting.values()):
                        with contextlib.suppress(trio.WouldBlock):
                            waiter.send_nowait(reply)
                elif isinstance(rid, int) and (send := self._waiting.get(rid)):
                    send.send_nowait(reply)
        except Exception as exc:  # noqa: BLE001 - any read failure ends the channel
            log.debug("channel closed", peer=self.peer, reason=repr(exc))
        finally:
            self.fail()

    def fail(self) -> None:
        self.closed = True
        for send in list(self._waiting.values()):
            send.close()


class Channels:
    """The caller's open channels, by (peer, protocol); reader tasks live in its nursery.

    With `lanes` on, each (peer, protocol) also gets a lane when the peer offers one, and
    requests go over the lane while it is up.
    """

    def __init__(self, host: IHost, lanes: bool = True,
                 connect: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self.host = host
        self.lanes = lanes
        self.connect = connect
        """How to reach a peer we hold no connection to (the node's dialer: directly or
        through one of its relays); py-libp2p's own dial knows no circuit addresses."""
        self._open: dict[tuple[str, str], Channel] = {}
        self._lanes: dict[tuple[str, str], Channel] = {}
        self._lane_next: dict[tuple[str, str], float] = {}
        self._lane_fails: dict[tuple[str, str], int] = {}
        """Lane attempts in a row that did not come up, by (peer, protocol)."""
        self._opening: dict[tuple[str, str], trio.Lock] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def request(self, peer: str, protocol: str, msg: dict[str, Any],
                      wait_s: float) -> dict[str, Any]:
        channel = await self._get(peer, protocol)
        try:
            return await channel.request(msg, wait_s)
        except Refused:
            raise
        except HopFailed:
            self.drop(peer)
            raise

    async def notify(self, peer: str, protocol: str, msg: dict[str, Any], wait_s: float) -> None:
        """A one-way message to `peer` (HopFailed when it cannot be sent)."""
        channel = await self._get(peer, protocol)
        try:
            await channel.notify(msg, wait_s)
        except HopFailed:
            self.drop(peer)
            raise

    def lanes_up(self) -> list[tuple[str, str]]:
        """(peer, protocol) pairs whose requests go over a lane now."""
        return [k for k, c in self._lanes.items() if not c.closed]

    def on_libp2p(self) -> list[tuple[str, str]]:
        """(peer, protocol) pairs whose requests still go over libp2p (no lane up)."""
        return [k for k, c in self._open.items() if not c.closed and not self.lane_open(*k)]

    def lane_open(self, peer: str, protocol: str) -> bool:
        """Whether requests to `peer` on `protocol` go over a lane now."""
        lane_channel = self._lanes.get((peer, protocol))
        return lane_channel is not None and not lane_channel.closed

    async def _get(self, peer: str, protocol: str) -> Channel:
        key = (peer, protocol)
        lane_channel = self._lanes.get(key)
        if lane_channel is not None and not lane_channel.closed:
            return lane_channel
        channel = await self._get_stream(peer, protocol)
        now = trio.current_time()
        if self.lanes and self._nursery is not None and self._lane_next.get(key, 0) <= now:
            first, most = lane.LANE_RETRY_S
            fails = self._lane_fails.get(key, 0)
            self._lane_next[key] = now + min(most, first * 2 ** min(fails, 16))
            self._lane_fails[key] = fails + 1  # until the lane is up
            self._nursery.start_soon(self._open_lane, key, channel)
        return channel

    async def _open_lane(self, key: tuple[str, str], channel: Channel) -> None:
        peer = key[0]
        try:
            offer = await channel.request({"op": "lane"}, LANE_OPEN_S)
            ips = self._lane_ips(peer, channel)
            if not ips:
                raise WireError("no direct address of the peer is known (relayed)")
            sealed, tried = None, []
            with trio.move_on_after(LANE_OPEN_S):
                for ip in ips:  # the ticket is spent only where the connect succeeds
                    try:
                        sealed = await lane.connect(ip, offer, MAX_FRAME, LANE_OPEN_S)
                        break
                    except Exception as exc:  # noqa: BLE001 - try the next address
                        tried.append(f"{ip}: {exc!r}")
            if sealed is None:
                raise WireError(f"no lane server answered at {'; '.join(tried) or ips}")
        except Exception as exc:  # noqa: BLE001 - lanes are optional: any failure keeps libp2p
            log.info("no lane: staying on libp2p", peer=peer, protocol=key[1], reason=repr(exc))
            return
        lane_channel = Channel(peer, sealed)
        assert self._nursery is not None
        self._nursery.start_soon(lane_channel.read_replies)
        self._lanes[key] = lane_channel
        self._lane_fails.pop(key, None)
        self._lane_next[key] = trio.current_time() + 5.0  # a lane that breaks may be renewed soon
        log.debug("lane open", peer=peer, protocol=key[1], address=ip)

    def _lane_ips(self, peer: str, channel: Channel) -> list[str]:
        """Where the peer's lane server may be: the IP of our connection to it; else the
        IPs of the direct addresses we know of it. py-libp2p reports no address for a
        WebSocket connection (nor a relayed one): two local nodes that happened to connect
        over WebSocket at start-up never got a lane, and their hops stayed 4x slower."""
        remote = channel.stream.get_remote_address()  # type: ignore[union-attr]
        if remote:
            return [remote[0]]
        try:
            addrs = [str(a) for a in self.host.get_peerstore().addrs(ID.from_base58(peer))]
        except Exception:  # noqa: BLE001 - a peer we hold no addresses of
            return []
        return list(dict.fromkeys(ip for a in addrs if not is_circuit(a)
                                  and (ip := lane.tcp_ip(a))))

    async def _get_stream(self, peer: str, protocol: str) -> Channel:
        key = (peer, protocol)
        async with self._opening.setdefault(key, trio.Lock()):
            channel = self._open.get(key)
            if channel is not None and not channel.closed:
                return channel
            try:
                with trio.fail_after(OPEN_TIMEOUT_S):
                    stream = await self._new_stream(ID.from_base58(peer), protocol)
            except trio.TooSlowError:
                raise Unreachable(peer, f"no {protocol} stream within {OPEN_TIMEOUT_S:g} s") \
                    from None
            except Exception as exc:  # noqa: BLE001 - unreachable peers raise many types
                raise Unreachable(peer, f"cannot open {protocol}: {exc!r}") from None
            channel = Channel(peer, stream)
            assert self._nursery is not None, "Channels.run must be started first"
            self._nursery.start_soon(channel.read_replies)
            self._open[key] = channel
            return channel

    async def _new_stream(self, pid: ID, protocol: str) -> INetStream:
        """A new stream, redialling once if the connection we have cannot carry one.

        py-libp2p sometimes keeps a connection whose muxer never finished its upgrade (two
        peers dialling each other at once, a busy machine): every stream on it fails. The
        stream is then tried once more on a fresh connection.
        """
        if self.connect is not None and not self.host.get_network().get_connections(pid):
            await self.connect(str(pid))
        try:
            return await self.host.new_stream(pid, [protocol])
        except Exception as exc:  # noqa: BLE001 - unreachable peers raise many types
            if not self.host.get_network().get_connections(pid):
                raise
            log.debug("stream failed on an existing connection: redialling", peer=str(pid),
                      reason=repr(exc)[:200])
            await self.host.get_network().close_peer(pid)
            return await self.host.new_stream(pid, [protocol])

    def drop(self, peer: str) -> None:
        """Forget (and reset) every channel and lane to `peer`: it failed or timed out."""
        for table in (self._open, self._lanes):
            for key in [k for k in table if k[0] == peer]:
                channel = table.pop(key)
                channel.fail()
                if self._nursery is not None:
                    self._nursery.start_soon(_reset, channel.stream)


async def _reset(stream: INetStream | lane.SealedStream) -> None:
    # resetting a dead stream may fail any way
    with trio.move_on_after(1), contextlib.suppress(Exception):
        await stream.reset()


async def serve(stream: INetStream | lane.SealedStream, handle: Handler, idle_s: float, *,
                peer: str = "", lanes: lane.LaneServer | None = None, protocol: str = "",
                parse: Callable[[dict[str, Any]], Any] | None = None,
                inline: Callable[[Any], bool] | None = None,
                intake: Intake | None = None) -> None:
    """Answer requests on one stream until it ends or stays idle past `idle_s`.

    Each frame goes through `parse` (the protocol's validation into its message types) as
    it is read: a malformed one is answered "bad" and never reaches `handle`, which gets
    the parsed message (the frame itself without `parse`). Each request runs in its own
    task so a slow one does not hold up the next; replies are written under one lock,
    whole frames at a time. A one-way message that `inline` accepts is handled in the
    reader's own task instead (no task to start, no pass through the scheduler before it
    runs): for short work that would hold the event loop anyway, such as a decode step
    computed in place; the stream's next frame waits for it. A handler's Refusal is
    answered with its code, any other error with "bad". `peer` is the caller (read from
    the libp2p connection when not given); with `lanes`, a request {op: "lane"} is
    answered with a ticket for a lane to this `protocol`. With `intake`, how large a frame
    the peer may send and how many bytes of its frames may be in flight depend on whether
    the server works for it (Intake): a frame over the limit is answered {id: 0, error,
    code: "bad"} from its length, unread, and the stream ends.
    """
    if not peer:
        peer = stream.muxed_conn.peer_id.to_string()  # type: ignore[union-attr]
    reader = FrameReader(stream, MAX_FRAME)
    lock = trio.Lock()
    if intake is not None and isinstance(stream, lane.SealedStream):
        stream.check = functools.partial(intake.check, peer)  # records are read whole

    async def offer_lane(caller: str, _: Any) -> dict[str, Any]:
        assert lanes is not None
        return lanes.offer(caller, protocol)

    async def refuse(_: str, exc: WireError) -> dict[str, Any]:
        raise exc

    async def answer(rid: int, op: Any, handler: Handler, request: Any, size: int) -> None:
        try:
            try:
                reply = await handler(peer, request)
            except KvasirError as exc:
                reply = _refusal(exc)
            except Exception:  # noqa: BLE001 - a bug answers this request, not the stream's others
                log.exception("request handler failed", peer=peer, op=str(op)[:32])
                reply = {"error": "the peer failed to handle this request (see its log)",
                         "code": "bad"}
            await send(rid, op, reply)
        finally:
            if intake is not None:
                intake.give(peer, size)

    async def send(rid: int, op: Any, reply: dict[str, Any]) -> None:
        if rid == 0:  # one-way: nobody waits for an answer
            if "error" in reply:
                log.debug("one-way request failed", peer=peer, op=str(op)[:32],
                          error=str(reply["error"])[:200])
            return
        try:
            await write({**reply, "id": rid})
        except Exception as exc:  # noqa: BLE001 - the caller went away
            log.debug("reply not delivered", peer=peer, reason=repr(exc))

    async def write(value: dict[str, Any]) -> None:
        if isinstance(stream, lane.SealedStream):  # sends each frame whole on its own
            await stream.write(frame(value, MAX_FRAME))
        else:
            async with lock:
                await write_frame(stream, value, MAX_FRAME)

    async def refuse_frame(exc: FrameTooLarge) -> None:
        log.info("frame refused unread: the stream ends", peer=peer, protocol=protocol,
                 reason=str(exc))
        with trio.move_on_after(1), contextlib.suppress(Exception):
            await write({**_refusal(exc), "id": 0})

    async def next_frame() -> tuple[Any, int]:
        """The next frame and its size, once the peer may send it (intake). A frame over
        its limit is answered unread and ends the stream; one within MAX_FRAME is read
        and dropped first (a chunk at a time: its sender, writing it whole, then reads
        why, and has LINGER_S to), one past it is not (the stream is reset under it)."""
        try:
            size = await reader.length()
        except FrameTooLarge as exc:  # past MAX_FRAME, or a lane record its intake refused
            await refuse_frame(exc)
            raise
        if intake is None:
            return await reader.body(size), size
        try:
            intake.check(peer, size)
        except FrameTooLarge as exc:
            await refuse_frame(exc)
            await reader.skip(size)
            # a reset drops what the peer has not read yet: it ends the stream first
            with trio.move_on_after(LINGER_S), contextlib.suppress(Exception):
                while await stream.read(SKIP_CHUNK):
                    pass
            raise
        idle.deadline = math.inf  # waiting for its own frames to be handled: not idle
        await intake.take(peer, size)
        idle.deadline = trio.current_time() + idle_s
        try:
            return await reader.body(size), size
        except BaseException:
            intake.give(peer, size)
            raise

    try:
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as idle:  # one scope, its deadline moved on every frame
                while True:
                    idle.deadline = trio.current_time() + idle_s
                    msg, size = await next_frame()
                    if not isinstance(msg, dict) or not isinstance(msg.get("id"), int):
                        if intake is not None:
                            intake.give(peer, size)
                        raise WireError("request: expected a map with an integer id")
                    rid, op = msg["id"], msg.get("op")
                    if op == "lane" and lanes is not None:
                        nursery.start_soon(answer, rid, op, offer_lane, msg, size)
                        continue
                    if "trace" in msg:  # a traced step: when it arrived (its sender cannot say)
                        msg["rx"] = time.monotonic()
                    try:
                        request = msg if parse is None else parse(msg)
                    except WireError as exc:
                        nursery.start_soon(answer, rid, op, refuse, exc, size)
                        continue
                    if inline is not None and rid == 0 and inline(request):
                        idle.deadline = math.inf  # the stream is busy, not idle
                        await answer(rid, op, handle, request, size)
                    else:
                        nursery.start_soon(answer, rid, op, handle, request, size)
            log.debug("stream idle: closing it", peer=peer, idle_s=idle_s)
            nursery.cancel_scope.cancel()
    except Exception as exc:  # noqa: BLE001 - a malformed frame, a reset: in a group, any type
        log.debug("stream ended", peer=peer, reason=repr(exc))
    finally:
        await _reset(stream)


def _refusal(exc: KvasirError) -> dict[str, Any]:
    """The error reply for `exc`: a Refusal's own code, "bad" for anything else."""
    return (exc if isinstance(exc, Refusal) else Refusal("bad", str(exc))).to_wire()
