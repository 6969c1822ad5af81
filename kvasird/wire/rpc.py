"""Request/response with ids, and one-way messages, over one long-lived stream: the one
shape of every channel protocol (stage, experts, settle), whatever it carries.

Design. Opening a stream costs ~8 ms in py-libp2p (STACK.md), so a caller keeps one stream
per (peer, protocol) and multiplexes: every request carries an ``id``, the reply echoes it,
and a reader task hands each reply to its waiter. Every wait has a timeout, because a dead
peer is never noticed by py-libp2p: on a timeout or a broken stream the channel fails, and
every request still waiting on it fails at once.

    Channel.request(msg) ──{id, op, ...}──▶ serve() ─parse─▶ handle (a task per request)
                    ◀── read_replies() ◀──{id, ...}──┘
    Channel.notify(msg)  ──{id: 0, op, ...}──▶ serve()  (no answer, not even an error)

A message is its type's ``to_wire()`` (wire.protocols: ``op`` names it); the channel adds
only ``id``. serve() hands each frame to the protocol's ``parse`` as it is read, so a
handler only sees validated messages; a handler's Refusal becomes the reply {error, code},
which request() raises as Refused (a code outside CODES reads as "bad"). What a server
reads from a peer depends on whether it works for that peer (Intake): a frame over its
limit is refused from its length prefix, its body never read, and the stream ends.

Hooks, for what a transport or a protocol adds without this module knowing it:

    own       {op: handler}: requests the server answers itself, before the protocol's
              parse (inference's lanes: a LaneAsk answered with a ticket)
    arrived   called with each request frame as read, before its parse (step tracing
              stamps when a traced step arrived: its sender cannot say)
    inline    one-way messages short enough to handle in the reader's own task (a decode
              step computed in place)

Streams: any ByteStream with ``reset``. One that sends each frame as a whole record within a
deadline of its own (``whole_records``: a lane) is written without the channel's lock, and
with an Intake its records are checked from their length before they are read. Who keeps
which channel open, and moves it onto a faster transport, is the caller's business
(inference.transport.channel.Channels).

The errors a caller sees are drawn in kvasird/errors.py: HopFailed (the peer failed: route
around it), Refused, Silent, Unreachable; a server raises Refusal.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, Protocol, cast, get_args

import trio

from kvasird.errors import KvasirError, PeerError, WireError
from kvasird.logs import get_logger
from kvasird.wire.framing import (
    SKIP_CHUNK,
    ByteStream,
    FrameReader,
    FrameTooLarge,
    frame,
    write_frame,
)

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
log = get_logger("kvasird.wire.rpc")

Code = Literal["busy", "gone", "bad", "unpaid", "unreachable", "broken"]
"""Why a peer refused, the whole closed set:
    busy         out of capacity now (sessions, KV room, expert workers): retry elsewhere, soon
    gone         no such session (expired, or the node restarted); on a forwarded chain, the
                 next hop failed
    bad          the request was malformed or asked for what this node does not serve
    unpaid       this node works only for gateways that pay it (a paid network)
    unreachable  on a forwarded chain: no stream to the next hop could be opened
    broken       the named peer's output was unusable (NaN or infinity: its weights may be
                 corrupt): the refusing node's own, or on a forwarded chain the hop before
                 it, which sent such rows on unchecked
A node older than a code reads it as "bad", which blames the refusing node all the same."""
CODES: frozenset[str] = frozenset(get_args(Code))


def code_of(value: Any) -> Code:
    """A code read from a peer: itself when it is one of CODES, else "bad"."""
    return cast(Code, value) if isinstance(value, str) and value in CODES else "bad"


class Refusal(KvasirError):
    """This node refuses a request; the transport answers the caller with `code` and
    `detail` (a client sees it as Refused)."""

    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code: Code = code
        self.detail = detail

    def to_wire(self) -> dict[str, Any]:
        return {"error": self.detail[:500], "code": self.code}


class HopFailed(PeerError):
    """A peer called failed; the caller routes around it (inference: replaces it and replays)."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer[:16]}… failed: {reason}")
        self.peer = peer
        self.reason = reason


class Refused(HopFailed):
    """The peer answered, but refused (its Refusal): ``code`` says why, one of CODES."""

    def __init__(self, peer: str, code: Code, reason: str) -> None:
        super().__init__(peer, f"{code}: {reason}")
        self.code: Code = code
        self.detail = reason


class Silent(HopFailed):
    """The peer did not answer in time, though nothing broke: busy on a loaded machine,
    or hung. Unlike a broken stream or a refused connection, one missed answer proves
    little."""


class Unreachable(HopFailed):
    """No stream to the peer could be opened. Before any work was sent, this says little
    about the peer (we may hold no connection to it yet, a relay may be slow): it is
    avoided for a short while (inference.errors.UNREACHABLE_S), not the full sentence of a
    peer that failed at work."""


Handler = Callable[[str, Any], Awaitable[dict[str, Any]]]
"""(caller peer id, request: the frame as its protocol's parse made it) -> reply's wire
form; raising Refusal answers with its code, any other error with "bad"."""


class Stream(ByteStream, Protocol):
    """What a channel runs over: a libp2p stream, or a lane's sealed records."""

    async def reset(self) -> None: ...


def _whole(stream: Any) -> bool:
    """Whether `stream` sends each frame as one record, whole, within its own deadline."""
    return getattr(stream, "whole_records", False)


def notification(msg: dict[str, Any]) -> bytes:
    """A one-way message as the frame Channel.notify writes (for Channel.notify_frame)."""
    return frame({**msg, "id": 0}, MAX_FRAME)


class _Failures:
    """Every way a send or wait can fail, as the HopFailed that routes around the peer
    (a plain class: this wraps every frame sent, and contextlib's generators cost more)."""

    def __init__(self, peer: str, timed_out: str) -> None:
        self.peer, self.timed_out = peer, timed_out

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> Literal[False]:
        if exc is None or isinstance(exc, KvasirError):
            return False
        if isinstance(exc, trio.TooSlowError):
            raise Silent(self.peer, self.timed_out) from None
        if isinstance(exc, trio.EndOfChannel | trio.BrokenResourceError | trio.ClosedResourceError):
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
            raise FrameTooLarge(
                length,
                SMALL_FRAME,
                " for a peer with no session here "
                "(open a session, or have a request admitted, first)",
            )

    async def take(self, peer: str, length: int) -> None:
        """Count a frame of `length` bytes (one ``check`` let through) in flight for `peer`,
        once its budget has room; a frame alone always fits."""
        while True:
            held = self._held.get(peer, 0)
            total = held + length
            if not held or total <= SMALL_IN_FLIGHT or total <= IN_FLIGHT and self.admitted(peer):
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

    def __init__(self, peer: str, stream: Stream) -> None:
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
            with (
                _Failures(self.peer, f"no answer to {msg.get('op')!r} within {wait_s:g} s"),
                trio.fail_after(wait_s),
            ):
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

    async def notify_frame(self, data: bytes, wait_s: float) -> None:
        """Send a one-way message already framed (`notification`): the same bytes may go
        on several channels."""
        if self.closed:
            raise HopFailed(self.peer, "the stream broke")
        with _Failures(self.peer, f"could not send a message within {wait_s:g} s"):
            await self._write_data(data, wait_s)

    async def _write_frame(self, value: dict[str, Any], wait_s: float) -> None:
        await self._write_data(frame(value, MAX_FRAME), wait_s)

    async def _write_data(self, data: bytes, wait_s: float) -> None:
        if _whole(self.stream):  # one frame is one record, sent whole (or ends) within wait_s
            await self.stream.write(data, wait_s)  # type: ignore[call-arg]
            return
        with trio.fail_after(wait_s):
            await self._write.acquire()
        try:
            # A frame cut short by a cancellation (a client that went away) would corrupt
            # every later frame on the stream: it is always written whole, within the
            # request's time, and a frame that cannot be ends the channel.
            with trio.CancelScope(shield=True, deadline=trio.current_time() + wait_s) as writing:
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


async def reset(stream: Stream) -> None:
    """Reset `stream` within a second, whatever fails (resetting a dead stream may fail
    any way)."""
    with trio.move_on_after(1), contextlib.suppress(Exception):
        await stream.reset()


async def serve(
    stream: Stream,
    handle: Handler,
    idle_s: float,
    *,
    peer: str = "",
    protocol: str = "",
    parse: Callable[[dict[str, Any]], Any] | None = None,
    inline: Callable[[Any], bool] | None = None,
    intake: Intake | None = None,
    own: Mapping[str, Handler] | None = None,
    arrived: Callable[[dict[str, Any]], None] | None = None,
) -> None:
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
    the libp2p connection when not given), `protocol` what the logs name. A request whose
    op is in `own` goes to that handler instead, unparsed (the transport's own requests: a
    lane offer); `arrived` sees every other request frame as read, before its parse. With
    `intake`, how large a frame the peer may send and how many bytes of its frames may be
    in flight depend on whether the server works for it (Intake): a frame over the limit
    is answered {id: 0, error, code: "bad"} from its length, unread, and the stream ends.
    """
    if not peer:
        peer = stream.muxed_conn.peer_id.to_string()  # type: ignore[attr-defined]
    reader = FrameReader(stream, MAX_FRAME)
    lock = trio.Lock()
    if intake is not None and _whole(stream):
        stream.check = functools.partial(intake.check, peer)  # type: ignore[attr-defined]

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
                reply = {
                    "error": "the peer failed to handle this request (see its log)",
                    "code": "bad",
                }
            await send(rid, op, reply)
        finally:
            if intake is not None:
                intake.give(peer, size)

    async def send(rid: int, op: Any, reply: dict[str, Any]) -> None:
        if rid == 0:  # one-way: nobody waits for an answer
            if "error" in reply:
                log.debug(
                    "one-way request failed",
                    peer=peer,
                    op=str(op)[:32],
                    error=str(reply["error"])[:200],
                )
            return
        try:
            await write({**reply, "id": rid})
        except Exception as exc:  # noqa: BLE001 - the caller went away
            log.debug("reply not delivered", peer=peer, reason=repr(exc))

    async def write(value: dict[str, Any]) -> None:
        if _whole(stream):  # sends each frame whole on its own
            await stream.write(frame(value, MAX_FRAME))
        else:
            async with lock:
                await write_frame(stream, value, MAX_FRAME)

    async def refuse_frame(exc: FrameTooLarge) -> None:
        log.info(
            "frame refused unread: the stream ends", peer=peer, protocol=protocol, reason=str(exc)
        )
        with trio.move_on_after(1), contextlib.suppress(Exception):
            await write({**_refusal(exc), "id": 0})

    async def next_frame() -> tuple[Any, int]:
        """The next frame and its size, once the peer may send it (intake). A frame over
        its limit is answered unread and ends the stream; one within MAX_FRAME is read
        and dropped first (a chunk at a time: its sender, writing it whole, then reads
        why, and has LINGER_S to), one past it is not (the stream is reset under it)."""
        try:
            size = await reader.length()
        except FrameTooLarge as exc:  # past MAX_FRAME, or a record its intake refused
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
                    if own is not None and isinstance(op, str) and op in own:
                        nursery.start_soon(answer, rid, op, own[op], msg, size)
                        continue
                    if arrived is not None:
                        arrived(msg)
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
        await reset(stream)


def _refusal(exc: KvasirError) -> dict[str, Any]:
    """The error reply for `exc`: a Refusal's own code, "bad" for anything else."""
    return (exc if isinstance(exc, Refusal) else Refusal("bad", str(exc))).to_wire()
