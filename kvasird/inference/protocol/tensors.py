"""Arrays on the wire: raw little-endian bytes in a msgpack bin field, with dtype and shape.

    {"dt": "f32" | "f16" | "i32", "shape": [d0, d1, ...], "data": <bin>}

Decoding checks everything against the receiver's expectations (dtype set, rank, fixed
dimensions, element limit, byte length) before numpy sees the bytes, and always hands
back float32 or int32, so f16 is a wire format only. Floats must be finite, unless the
receiver asks for them as sent (``finite=False``) to say itself whose fault they are not:
a stage handed NaN rows by the hop before it names that hop (server.stage).

``decode`` is ``view`` (the checks, no copy) then ``widen`` (float32, finite): a server
views a request's rows when it parses the frame and widens them only once it knows it
works for the sender (a session here, an admitted gateway), so a stranger's frame never
costs a copy of its rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvasird.errors import WireError

DTYPES: dict[str, np.dtype[Any]] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "i32": np.dtype("<i4"),
}
MAX_ELEMENTS = 1 << 26
DIGEST_BYTES = 16
"""Bytes of an array's digest (`digest`): SHA-256 cut to 128 bits, still out of reach of
anyone who would need a second array with a digest they committed to."""


def encode(x: np.ndarray, dt: str) -> dict[str, Any]:
    """`x` as `dt` ("f32", "f16" or "i32") bytes; floats are rounded to f16 when asked."""
    data = np.ascontiguousarray(x, DTYPES[dt])
    return {"dt": dt, "shape": list(data.shape), "data": data.tobytes()}


def digest(x: np.ndarray, dt: str) -> bytes:
    """What a hop commits to for an array it received or sent (stage.Closed.steps): SHA-256
    over the wire type, the shape and the bytes as `dt`, cut to DIGEST_BYTES. The sender,
    which encodes the array, and the receiver, which views the frame, get the same digest
    (f16 widened to f32 and rounded back is the same f16)."""
    data = np.ascontiguousarray(x, DTYPES[dt])
    h = hashlib.sha256(f"{dt}{list(data.shape)}".encode())
    h.update(data.data.cast("B"))
    return h.digest()[:DIGEST_BYTES]


def decode(
    value: Any, what: str, kinds: Sequence[str], shape: Sequence[int | None], *, finite: bool = True
) -> np.ndarray:
    """A validated array; `shape` gives the rank, with None for a free dimension (>= 1).
    With ``finite=False`` floats may hold NaN or infinity: the caller checks them."""
    return widen(view(value, what, kinds, shape), what, finite=finite)


def view(value: Any, what: str, kinds: Sequence[str], shape: Sequence[int | None]) -> np.ndarray:
    """The array as it travelled, validated as ``decode`` validates it but not converted: a
    read-only view of the frame's bytes (f16 stays f16), so a receiver can look at who
    sent it before it pays for a copy the size of the rows (``widen``)."""
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected an array map")
    dt, dims, data = value.get("dt"), value.get("shape"), value.get("data")
    if dt not in kinds:
        raise WireError(f"{what}.dt: expected one of {list(kinds)}, got {dt!r}")
    if type(dims) is not list or len(dims) != len(shape):
        raise WireError(f"{what}.shape: expected {list(shape)}, got {dims!r:.60}")
    n = 1  # exact: numpy's int64 product wraps on huge dimensions
    for d, want in zip(dims, shape, strict=True):  # a loop: every array of every hop comes here
        if type(d) is not int or d < 1 or want is not None and d != want:
            raise WireError(f"{what}.shape: expected {list(shape)}, got {dims!r:.60}")
        n *= d
    if n > MAX_ELEMENTS:
        raise WireError(f"{what}: {n} elements exceed the limit of {MAX_ELEMENTS}")
    dtype = DTYPES[str(dt)]
    if not isinstance(data, bytes) or len(data) != n * dtype.itemsize:
        raise WireError(f"{what}.data: expected {n * dtype.itemsize} bytes")
    return np.frombuffer(data, dtype).reshape(dims)


def widen(x: np.ndarray, what: str, *, finite: bool = True) -> np.ndarray:
    """A ``view``'s values as the daemon computes with them: ids as they are, floats as a
    float32 copy, refused when not all finite unless ``finite=False``."""
    if x.dtype.kind == "i":
        return x
    x = x.astype(np.float32)
    if finite and not np.isfinite(x).all():
        raise WireError(f"{what}: contains NaN or infinity")
    return x
