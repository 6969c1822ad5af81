"""A fast reader of a GGUF file's header: metadata and the tensor table, data left on disk.

gguf-py's GGUFReader builds two numpy arrays per string, which takes 1.6 s on the
bundled model's 98k tokenizer strings; manifests must be cheap, so this parses the
header with struct into plain values (~0.1 s) and maps the tensor data with mmap.
Only little-endian GGUF v2/v3 is read (all that llama.cpp writes).

Metadata values are kept in the *canonical form* the manifest hashes:
scalars as int/float/bool, strings as raw bytes, arrays as ``(sub_type, items)``
where items are raw little-endian bytes for numeric/bool sub-types, a list of bytes
for strings, and a list of ``(sub_type, items)`` for nested arrays.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvasird.errors import ModelError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
"""struct format of every fixed-size GGUF value type."""

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFFormatError(ModelError):
    """A file is not a GGUF this reader understands."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table."""

    name: str
    """Tensor name, e.g. ``blk.3.ffn_up_exps.weight``."""
    ggml_type: int
    """GGMLQuantizationType value."""
    ne: tuple[int, ...]
    """Shape in ggml order (ne[0] is the contiguous row length)."""
    offset: int
    """Offset of the data from the start of the data section, as the file records it."""
    length: int
    """Bytes of data (rows × row bytes)."""


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF except the tensor bytes."""

    version: int
    """GGUF format version (2 or 3)."""
    metadata: tuple[tuple[str, int, Any], ...]
    """(key, GGUFValueType, canonical value) in file order."""
    tensors: tuple[TensorInfo, ...]
    """The tensor table in file order."""
    alignment: int
    """Data alignment (general.alignment or 32)."""
    data_offset: int
    """Absolute file offset of the data section."""


def tensor_nbytes(ggml_type: int, ne: tuple[int, ...]) -> int:
    """Bytes of a tensor of this type and shape; raises if rows are not whole quant blocks."""
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFFormatError(
            f"unknown ggml type {ggml_type}: this kvasird is too old for the model; upgrade kvasird"
        ) from None
    if not ne or ne[0] % block:
        raise GGUFFormatError(
            f"row of {ne[:1]} elements is not a whole number of "
            f"{block}-element blocks of type {ggml_type}"
        )
    rows = 1
    for n in ne[1:]:
        rows *= n
    return rows * (ne[0] // block) * type_size


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(
                "GGUF header is truncated: the file is incomplete, fetch it again"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def string(self) -> bytes:
        return bytes(self.take(self.u64()))

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            sub, count = self.u32(), self.u64()
            return (sub, self.array(sub, count))
        fmt = SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFFormatError(f"unknown GGUF value type {vtype}")
        return struct.unpack_from("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def array(self, sub: int, count: int) -> Any:
        fmt = SCALAR_FORMATS.get(sub)
        if fmt is not None:
            return bytes(self.take(count * struct.calcsize(fmt)))
        if sub == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        return [self.value(sub) for _ in range(count)]


def read_header(path: Path) -> GGUFHeader:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFFormatError(f"{path} is too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return _parse(view, path, size)
            finally:
                view.release()


def _parse(view: memoryview, path: Path, size: int) -> GGUFHeader:
    cur = _Cursor(view)
    if bytes(cur.take(4)) != MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file (bad magic)")
    version = cur.u32()
    if version not in (2, 3):
        raise GGUFFormatError(
            f"{path} is GGUF version {version}; only versions 2 and 3 (little-endian) are supported"
        )
    n_tensors, n_kv = cur.u64(), cur.u64()
    metadata = []
    for _ in range(n_kv):
        key = cur.string().decode("utf-8")
        vtype = cur.u32()
        metadata.append((key, vtype, cur.value(vtype)))
    alignment = next(
        (int(v) for k, _, v in metadata if k == "general.alignment"), DEFAULT_ALIGNMENT
    )
    tensors = []
    for _ in range(n_tensors):
        name = cur.string().decode("utf-8")
        ne = tuple(cur.u64() for _ in range(cur.u32()))
        ggml_type, offset = cur.u32(), cur.u64()
        tensors.append(TensorInfo(name, ggml_type, ne, offset, tensor_nbytes(ggml_type, ne)))
    data_offset = -(-cur.pos // alignment) * alignment
    for t in tensors:
        if data_offset + t.offset + t.length > size:
            raise GGUFFormatError(
                f"{path}: tensor {t.name} runs past the end of the file; "
                "the file is truncated, fetch it again"
            )
    return GGUFHeader(version, tuple(metadata), tuple(tensors), alignment, data_offset)
