"""The ASGI response that runs a generation, streamed (SSE) or answered whole (JSON).

It owns the request's lifetime: admission (the concurrency limit), a watcher that
cancels everything when the client disconnects (which closes the Generator's stream
and frees its KV cache), the first event awaited *before* any header is sent (so a
generator that cannot start still gets its own status: 404, 429, 503), then either
SSE events with keep-alive pings while nothing else is sent, or one JSON body. The
choices of a request (``n``) generate side by side; it ends when each has its Done,
and the first error of any ends them all.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from kvasird.errors import KvasirError
from kvasird.gateway import payment
from kvasird.gateway.errors import ApiError, from_generation
from kvasird.gateway.generation import Choice, Done, Piece, produce
from kvasird.gateway.stats import Slot
from kvasird.http import note_access
from kvasird.inference.api import TokenEvent
from kvasird.logs import get_logger

if TYPE_CHECKING:
    from kvasird.gateway.service import Gateway, Job

log = get_logger("kvasird.gateway")

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class Renderer(Protocol):
    """One API's rendering of the internal stream (openai.py, anthropic.py)."""

    ping: bytes
    """The SSE keep-alive this API's clients ignore."""

    def error(self, err: ApiError) -> dict[str, Any]: ...

    def body(self, choices: list[Choice]) -> dict[str, Any]: ...

    def stream_start(self) -> list[bytes]: ...

    def stream_piece(self, piece: Piece) -> list[bytes]: ...

    def stream_end(self, dones: list[Done]) -> list[bytes]:
        """After the last choice ended; ``dones`` by choice index."""
        ...

    def stream_error(self, err: ApiError) -> list[bytes]: ...


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; ``data`` is JSON-encoded unless already text."""
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


async def send_json(
    send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class GenerationResponse:
    def __init__(self, gateway: Gateway, job: Job, renderer: Renderer) -> None:
        self.gateway, self.job, self.renderer = gateway, job, renderer
        self.charge: payment.Charge | None = None
        """Who pays for this request (None: free)."""
        self.produced = 0
        """Tokens handed to the client so far."""
        self.prompt_tokens = 0
        """Tokens in the prompt, once the generation has finished."""
        self.began = 0.0
        self.settled = False
        """The payment was split (or refunded) already."""

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        try:
            slot = self.gateway.stats.admit(self.gateway.config.max_concurrent)
        except ApiError as err:
            await send_json(send, err.status, self.renderer.error(err))
            return
        with slot:
            try:
                charge = await payment.charge(self.gateway, scope, self.job)
            except ApiError as err:
                await send_json(send, err.status, self.renderer.error(err), err.headers)
                slot.finish(err.status)
                return
            self.charge, self.began = charge, time.monotonic()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await self._run(send, slot)
                nursery.cancel_scope.cancel()
            if charge is not None and not self.settled:  # served (or left by the client)
                self.settled = True
                payment.record_work(
                    self.gateway, charge, self.job, self.produced, time.monotonic() - self.began
                )
            if nursery.cancel_scope.cancelled_caught and not slot.finished:
                log.info(
                    "client disconnected: generation cancelled",
                    request_id=self.job.request.request_id,
                )
        note_access(scope, prompt_tokens=self.prompt_tokens, completion_tokens=self.produced)

    async def _run(self, send: Send, slot: Slot) -> None:
        job = self.job
        out, received = trio.open_memory_channel[Piece | Done | KvasirError](0)
        async with trio.open_nursery() as nursery:
            async with out:
                for i, request in enumerate(job.requests()):
                    nursery.start_soon(
                        produce, job.generator, job.tokenizer, request, job.stops, i, out.clone()
                    )
            items = _Choices(received, job.n)
            try:
                first = await items.next()
            except KvasirError as exc:
                err = await self._failed(from_generation(exc))
                await send_json(send, err.status, self.renderer.error(err))
                slot.finish(err.status)
                nursery.cancel_scope.cancel()
                return
            slot.first_token()
            if job.stream:
                await self._stream(first, items, send, slot)
            else:
                await self._whole(first, items, send, slot)
            nursery.cancel_scope.cancel()

    async def _whole(
        self, first: Piece | Done | None, items: _Choices, send: Send, slot: Slot
    ) -> None:
        texts: list[list[str]] = [[] for _ in range(self.job.n)]
        tokens: list[list[TokenEvent]] = [[] for _ in range(self.job.n)]
        item: Piece | Done | None = first
        try:
            while item is not None:
                if isinstance(item, Piece):
                    texts[item.index].append(item.text)
                    tokens[item.index].extend(item.tokens)
                    self.produced += len(item.tokens)
                    slot.tokens(item.index, len(item.tokens))
                item = await items.next()
        except KvasirError as exc:
            err = await self._failed(from_generation(exc))
            await send_json(send, err.status, self.renderer.error(err))
            slot.finish(err.status)
            return
        dones = items.dones()
        slot.finish(200, sum(d.completion_tokens for d in dones), dones[0].prompt_tokens)
        self.gateway.refusal = None
        self.prompt_tokens = dones[0].prompt_tokens
        await send_json(
            send,
            200,
            self.renderer.body(
                [
                    Choice("".join(t), tuple(e), d)
                    for t, e, d in zip(texts, tokens, dones, strict=True)
                ]
            ),
            self._paid(),
        )

    async def _stream(
        self, first: Piece | Done | None, items: _Choices, send: Send, slot: Slot
    ) -> None:
        r = self.renderer
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                    *self._paid(),
                ],
            }
        )
        out = EventWriter(send)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(out.keep_alive, r.ping, self.gateway.config.ping_s)
            await out.write(r.stream_start())
            item: Piece | Done | None = first
            try:
                while item is not None:
                    if isinstance(item, Piece):
                        await out.write(r.stream_piece(item))
                        self.produced += len(item.tokens)
                        slot.tokens(item.index, len(item.tokens))
                    item = await items.next()
                dones = items.dones()
                slot.finish(200, sum(d.completion_tokens for d in dones), dones[0].prompt_tokens)
                self.gateway.refusal = None
                self.prompt_tokens = dones[0].prompt_tokens
                await out.write(r.stream_end(dones))
            except KvasirError as exc:
                err = await self._failed(from_generation(exc))
                await out.write(r.stream_error(err))
                slot.finish(err.status)
            nursery.cancel_scope.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _failed(self, err: ApiError) -> ApiError:
        """A paid request that failed: settle what was served and refund the rest on chain
        before the client hears of it, so that its error can name the refund."""
        if err.code == "gateway_not_served":
            self.gateway.refusal = (time.monotonic(), err.message)
        if self.charge is not None and not self.settled:
            self.settled = True
            with trio.CancelScope(shield=True):  # money moves whole, even if the client left
                err.message += await payment.refund(
                    self.gateway,
                    self.charge,
                    self.job,
                    self.produced,
                    time.monotonic() - self.began,
                )
        return err

    def _paid(self) -> list[tuple[bytes, bytes]]:
        """The headers of a reply: who paid, and what the gateway made of the request."""
        return [*self.job.headers(), *(self.charge.headers() if self.charge is not None else [])]


class _Choices:
    """The merged pieces of a request's choices, until each choice has ended."""

    def __init__(
        self, received: trio.MemoryReceiveChannel[Piece | Done | KvasirError], n: int
    ) -> None:
        self._received = received
        self._done: dict[int, Done] = {}
        self._n = n

    async def next(self) -> Piece | Done | None:
        """The next piece or Done of any choice; None once all have ended; a choice's
        error is raised."""
        if len(self._done) == self._n:
            return None
        item = await self._received.receive()
        if isinstance(item, KvasirError):
            raise item
        if isinstance(item, Done):
            self._done[item.index] = item
        return item

    def dones(self) -> list[Done]:
        return [self._done[i] for i in range(self._n)]


class EventWriter:
    """Serialises body writes of the event loop and the pinger; remembers the last one."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._lock = trio.Lock()
        self.last = trio.current_time()

    async def write(self, chunks: list[bytes]) -> None:
        if not chunks:
            return
        async with self._lock:
            await self._send(
                {"type": "http.response.body", "body": b"".join(chunks), "more_body": True}
            )
            self.last = trio.current_time()

    async def keep_alive(self, ping: bytes, every_s: float) -> None:
        while True:
            await trio.sleep_until(self.last + every_s)
            if trio.current_time() >= self.last + every_s:
                await self.write([ping])


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
