"""Length-prefixed msgpack frames with limits."""

from __future__ import annotations

import struct
from typing import Any, Protocol

import msgpack

from kvasird.errors import WireError

_LEN = struct.Struct(">I")
DEFAULT_MAX_FRAME = 1 << 20
"""1 MiB: the default upper bound of one frame; bulk protocols raise it explicitly."""
SKIP_CHUNK = 1 << 16
"""What a reader holds at once of a frame it drops unread (FrameReader.skip)."""


class FrameTooLarge(WireError):
    """A frame's length (read from its prefix, before its body) is over the reader's limit."""

    def __init__(self, length: int, limit: int, why: str = "") -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit}{why}")
        self.length, self.limit = length, limit


class ByteStream(Protocol):
    """What framing needs of a stream: libp2p's INetStream and our trio adapter both fit."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes, max_len: int = DEFAULT_MAX_FRAME) -> Any:
    """Decode msgpack with container limits tied to the frame size (no memory bombs)."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            max_bin_len=max_len,
            max_str_len=max_len,
            max_array_len=max_len // 2 + 1,
            max_map_len=max_len // 4 + 1,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"malformed msgpack from peer: {exc}") from None


class FrameReader:
    """Reads whole frames from a stream that may return short reads; never reads past a frame."""

    def __init__(self, stream: ByteStream, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._stream = stream
        self._max = max_frame
        self._buf = bytearray()

    async def _exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = await self._stream.read(n - len(self._buf))
            if not chunk:
                raise WireError(
                    "peer closed the stream in the middle of a frame"
                    if self._buf
                    else "peer closed the stream"
                )
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def length(self) -> int:
        """The next frame's length, its body not read yet (a server may look at who sends
        it first, and refuse it unread)."""
        (length,) = _LEN.unpack(await self._exactly(_LEN.size))
        if length > self._max:
            raise FrameTooLarge(length, self._max)
        return length

    async def skip(self, length: int) -> None:
        """Read and drop the body of a frame refused from its `length` (so that its sender,
        which writes it whole, reads why), never holding more than a chunk of it."""
        while length:
            if not self._buf:
                chunk = await self._stream.read(min(length, SKIP_CHUNK))
                if not chunk:
                    raise WireError("peer closed the stream in the middle of a frame")
                self._buf += chunk
            dropped = min(length, len(self._buf))
            del self._buf[:dropped]
            length -= dropped

    async def body(self, length: int) -> Any:
        """The decoded body of the frame whose `length` was just read."""
        return unpack(await self._exactly(length), self._max)

    async def read_raw(self) -> bytes:
        return await self._exactly(await self.length())

    async def read(self) -> Any:
        return unpack(await self.read_raw(), self._max)


async def read_frame(stream: ByteStream, max_frame: int = DEFAULT_MAX_FRAME) -> Any:
    """Read one frame (for request/response streams that carry exactly one)."""
    return await FrameReader(stream, max_frame).read()


def frame(value: Any, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One frame's bytes: the length, then the msgpack body."""
    body = pack(value)
    if len(body) > max_frame:
        raise WireError(f"refusing to send a frame of {len(body)} bytes (limit {max_frame})")
    return _LEN.pack(len(body)) + body


async def write_frame(stream: ByteStream, value: Any, max_frame: int = DEFAULT_MAX_FRAME) -> None:
    await stream.write(frame(value, max_frame))
