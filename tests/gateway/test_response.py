"""Keep-alive pings of a streaming response, on trio's virtual clock."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from kvasird.gateway.response import EventWriter

PING = b": ping\n\n"


async def test_a_quiet_stream_is_kept_alive_and_a_busy_one_is_not(
        autojump_clock: trio.testing.MockClock) -> None:
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["body"])

    out = EventWriter(send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(out.keep_alive, PING, 10.0)
        await out.write([b"data: 1\n\n"])
        await trio.sleep(25)
        for _ in range(5):
            await out.write([b"data: n\n\n"])
            await trio.sleep(4)
        nursery.cancel_scope.cancel()
    assert sent == [b"data: 1\n\n", PING, PING, *[b"data: n\n\n"] * 5]
