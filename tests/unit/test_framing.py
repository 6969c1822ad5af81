from __future__ import annotations

import struct

import msgpack
import pytest
import trio
import trio.testing

from kvasird.errors import WireError
from kvasird.wire import FrameReader, pack, unpack, write_frame


class Chunked:
    """A byte stream over a trio stream, returning at most ``chunk`` bytes per read."""

    def __init__(self, stream: trio.abc.Stream, chunk: int = 3) -> None:
        self.stream, self.chunk = stream, chunk

    async def read(self, n: int | None = None) -> bytes:
        return await self.stream.receive_some(min(n or self.chunk, self.chunk))

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)


async def test_frames_survive_short_reads() -> None:
    a, b = trio.testing.memory_stream_pair()
    sender, receiver = Chunked(a), FrameReader(Chunked(b))
    values = [{"t": "ping", "n": 1}, [1, 2, 3], b"x" * 1000]
    async with trio.open_nursery() as nursery:
        for v in values:
            nursery.start_soon(write_frame, sender, v)
            assert await receiver.read() == v
            await trio.testing.wait_all_tasks_blocked()


async def test_oversized_length_is_rejected_before_reading_the_body() -> None:
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(struct.pack(">I", 10_000_000))  # no body follows: must not wait for it
    with trio.fail_after(1), pytest.raises(WireError, match="exceeds the limit"):
        await FrameReader(Chunked(b, 64), max_frame=1024).read()


async def test_sender_refuses_frames_over_the_limit() -> None:
    a, _ = trio.testing.memory_stream_pair()
    with pytest.raises(WireError, match="refusing to send"):
        await write_frame(Chunked(a), b"x" * 2048, max_frame=1024)


async def test_stream_closed_mid_frame_is_a_wire_error() -> None:
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(struct.pack(">I", 10) + b"abc")
    await a.aclose()
    with pytest.raises(WireError, match="in the middle of a frame"):
        await FrameReader(Chunked(b)).read()


@pytest.mark.parametrize("data", [b"\xc1", b"\x92\x01", pack(1) + b"\x00"])
def test_malformed_msgpack_is_a_wire_error(data: bytes) -> None:
    with pytest.raises(WireError, match="malformed msgpack"):
        unpack(data)


def test_container_bombs_are_refused() -> None:
    bomb = b"\xdd" + struct.pack(">I", 2**31)  # array header claiming 2^31 items
    with pytest.raises(WireError):
        unpack(bomb, max_len=1024)
    assert unpack(msgpack.packb(list(range(10)))) == list(range(10))
