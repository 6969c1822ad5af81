"""Request/response with ids over one long-lived libp2p stream per peer and protocol.

Opening a stream costs ~8 ms in py-libp2p (STACK.md), so a caller keeps one stream per
(peer, protocol) and multiplexes: every request carries an ``id``, the reply echoes it,
and a reader task hands each reply to its waiter. Every wait has a timeout, because a
dead peer is never noticed by py-libp2p: on a timeout or a broken stream the channel
is reset and dropped, and every request still waiting on it fails at once.

    Channels.request(peer, proto, msg) ──▶ Channel ──frame {id, op, ...}──▶ serve()
                                     ◀── reader task ◀──frame {id, ...}────┘  (one task per request)
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from kvasird.errors import KvasirError, WireError
from kvasird.inference.errors import HopFailed, Refused
from kvasird.logs import get_logger
from kvasird.wire import FrameReader, write_frame

MAX_FRAME = 64 << 20
"""Largest frame: a prefill's hidden states (512 tokens × 8192 × 4 B = 16 MiB) with room."""
OPEN_TIMEOUT_S = 5.0
log = get_logger("kvasird.inference.channel")

Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
"""(caller peer id, request) -> reply; raising Refused answers with its code."""


class Channel:
    """One open stream to one peer, carrying many concurrent requests."""

    def __init__(self, peer: str, stream: INetStream) -> None:
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
            with trio.fail_after(wait_s):
                async with self._write:
                    await write_frame(self.stream, {**msg, "id": rid}, MAX_FRAME)
                reply = await recv.receive()
        except trio.TooSlowError:
            raise HopFailed(self.peer,
                            f"no answer to {msg.get('op')!r} within {wait_s:g} s") from None
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise HopFailed(self.peer, "the stream broke") from None
        except KvasirError:
            raise
        except Exception as exc:  # noqa: BLE001 - libp2p stream errors come in many types
            raise HopFailed(self.peer, f"sending failed: {exc!r}") from None
        finally:
            self._waiting.pop(rid, None)
        if "error" in reply:
            raise Refused(self.peer, str(reply.get("code", "bad")), str(reply["error"])[:500])
        return reply

    async def read_replies(self) -> None:
        try:
            while True:
                reply = await self._reader.read()
                rid = reply.get("id") if isinstance(reply, dict) else None
                if isinstance(rid, int) and (send := self._waiting.get(rid)):
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
    """The caller's open channels, by (peer, protocol); reader tasks live in its nursery."""

    def __init__(self, host: IHost) -> None:
        self.host = host
        self._open: dict[tuple[str, str], Channel] = {}
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

    async def _get(self, peer: str, protocol: str) -> Channel:
        key = (peer, protocol)
        async with self._opening.setdefault(key, trio.Lock()):
            channel = self._open.get(key)
            if channel is not None and not channel.closed:
                return channel
            try:
                with trio.fail_after(OPEN_TIMEOUT_S):
                    stream = await self.host.new_stream(ID.from_base58(peer), [protocol])
            except trio.TooSlowError:
                raise HopFailed(peer, f"no {protocol} stream within {OPEN_TIMEOUT_S:g} s") from None
            except Exception as exc:  # noqa: BLE001 - unreachable peers raise many types
                raise HopFailed(peer, f"cannot open {protocol}: {exc!r}") from None
            channel = Channel(peer, stream)
            assert self._nursery is not None, "Channels.run must be started first"
            self._nursery.start_soon(channel.read_replies)
            self._open[key] = channel
            return channel

    def drop(self, peer: str) -> None:
        """Forget (and reset) every channel to `peer`: it failed or timed out."""
        for key in [k for k in self._open if k[0] == peer]:
            channel = self._open.pop(key)
            channel.fail()
            if self._nursery is not None:
                self._nursery.start_soon(_reset, channel.stream)


async def _reset(stream: INetStream) -> None:
    # resetting a dead stream may fail any way
    with trio.move_on_after(1), contextlib.suppress(Exception):
        await stream.reset()


async def serve(stream: INetStream, handle: Handler, idle_s: float) -> None:
    """Answer requests on one stream until it ends or stays idle past `idle_s`.

    Each request runs in its own task so a slow one does not hold up the next; replies
    are written under one lock, whole frames at a time.
    """
    peer = stream.muxed_conn.peer_id.to_string()
    reader = FrameReader(stream, MAX_FRAME)
    lock = trio.Lock()

    async def answer(msg: dict[str, Any]) -> None:
        rid = msg.get("id")
        try:
            reply = await handle(peer, msg)
        except Refused as exc:
            reply = {"error": exc.detail, "code": exc.code}
        except (WireError, KvasirError) as exc:
            reply = {"error": str(exc)[:500], "code": "bad"}
        try:
            async with lock:
                await write_frame(stream, {**reply, "id": rid}, MAX_FRAME)
        except Exception as exc:  # noqa: BLE001 - the caller went away
            log.debug("reply not delivered", peer=peer, reason=repr(exc))

    try:
        async with trio.open_nursery() as nursery:
            while True:
                with trio.fail_after(idle_s):
                    msg = await reader.read()
                if not isinstance(msg, dict) or not isinstance(msg.get("id"), int):
                    raise WireError("request: expected a map with an integer id")
                nursery.start_soon(answer, msg)
    except (trio.TooSlowError, WireError) as exc:
        log.debug("stream ended", peer=peer, reason=repr(exc))
    except Exception as exc:  # noqa: BLE001 - resets surface as many types
        log.debug("stream failed", peer=peer, reason=repr(exc))
    finally:
        await _reset(stream)
