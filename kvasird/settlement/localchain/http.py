"""A small HTTP/1.1 server for the local chain's JSON-RPC, on trio and h11.

One JSON-RPC POST per request, keep-alive, bounded bodies, and ``GET /health`` like
a Solana validator. Lighter than an ASGI stack for a single endpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import h11
import trio

from kvasird.settlement.localchain.rpc import MAX_REQUEST_BYTES

_READ_CHUNK = 65536
_IDLE_TIMEOUT_S = 60.0
Handler = Callable[[bytes], bytes]


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on host:port; ``started`` reports the bound port once listening."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(partial(_connection, handler), listeners)


async def _connection(handler: Handler, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16384)
    async with stream:
        try:
            while await _serve_one(handler, conn, stream):
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return  # the client went away or spoke bad HTTP: drop only this connection


async def _serve_one(handler: Handler, conn: h11.Connection, stream: trio.SocketStream) -> bool:
    """Answer one request; False when the connection should close."""
    request = None
    with trio.move_on_after(_IDLE_TIMEOUT_S):
        request = await _read_request(conn, stream)
    if request is None:
        return False
    target, body = request
    status, payload = _route(handler, target, body)
    headers = [("content-type", "application/json"), ("content-length", str(len(payload)))]
    await stream.send_all(
        conn.send(h11.Response(status_code=status, headers=headers))
        + conn.send(h11.Data(data=payload))
        + conn.send(h11.EndOfMessage())
    )
    return conn.our_state is h11.DONE and conn.their_state is h11.DONE


def _route(handler: Handler, target: tuple[bytes, bytes], body: bytes | None) -> tuple[int, bytes]:
    method, path = target
    if method == b"GET" and path == b"/health":
        return 200, b'"ok"'
    if method != b"POST":
        return 405, b'{"error":"POST a JSON-RPC request"}'
    if body is None:
        return 413, b'{"error":"request body too large"}'
    return 200, handler(body)


async def _read_request(
    conn: h11.Connection, stream: trio.SocketStream
) -> tuple[tuple[bytes, bytes], bytes | None] | None:
    """The next request's (method, path) and body (None when over the limit), or None at close."""
    target: tuple[bytes, bytes] | None = None
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return None
        if event is h11.NEED_DATA:
            data = await stream.receive_some(_READ_CHUNK)
            conn.receive_data(data)
            if not data and conn.their_state is not h11.DONE:
                return None
        elif isinstance(event, h11.Request):
            target = (event.method, event.target)
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size <= MAX_REQUEST_BYTES:
                chunks.append(event.data)
        elif isinstance(event, h11.EndOfMessage) and target is not None:
            return target, (b"".join(chunks) if size <= MAX_REQUEST_BYTES else None)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None
