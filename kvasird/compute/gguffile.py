"""Read a GGUF's metadata and tensor table with ggml's own C parser.

gguf-py's reader parses every tokenizer string in Python (over a second for a 49k
vocab); ggml's parser reads the same header in milliseconds, and it is the parser the
runtime trusts, so the engine uses it. Tensor bytes are memory-mapped, never read whole.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvasird.compute.errors import WeightsError

_SCALAR_GETTERS = {
    0: "gguf_get_val_u8", 1: "gguf_get_val_i8", 2: "gguf_get_val_u16", 3: "gguf_get_val_i16",
    4: "gguf_get_val_u32", 5: "gguf_get_val_i32", 6: "gguf_get_val_f32", 7: "gguf_get_val_bool",
    10: "gguf_get_val_u64", 11: "gguf_get_val_i64", 12: "gguf_get_val_f64",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file and what it is."""

    name: str
    """GGUF tensor name, e.g. "blk.3.ffn_up_exps.weight"."""
    type: int
    """ggml type id (GGML_TYPE_*)."""
    ne: tuple[int, ...]
    """Shape in ggml order (ne[0] is the contiguous row length)."""
    offset: int
    """Absolute byte offset of the data in the file."""
    nbytes: int
    """Size of the data in bytes."""


class GGUFFile:
    """A GGUF file's scalar/string metadata, array lengths, and tensor table."""

    def __init__(self, path: str | Path) -> None:
        import ggml

        self.path = Path(path)
        if not self.path.is_file():
            raise WeightsError(f"{self.path}: no such GGUF file")
        meta = ctypes.c_void_p()
        params = ggml.gguf_init_params(no_alloc=True, ctx=ctypes.pointer(meta))
        ctx = ggml.gguf_init_from_file(str(self.path).encode(), params)
        if not ctx:
            raise WeightsError(f"{self.path} is not a readable GGUF file")
        try:
            self.metadata = _read_kv(ggml, ctx)
            self.tensors = _read_tensors(ggml, ctx, meta)
        finally:
            ggml.gguf_free(ctx)
            ggml.ggml_free(meta)
        self._map: np.memmap | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise WeightsError(f"{self.path} lacks metadata key {key!r}")
        return self.metadata[key]

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightsError(f"{self.path} holds no tensor {name!r}") from None

    def data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes (uint8, memory-mapped, read-only)."""
        t = self.info(name)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map[t.offset:t.offset + t.nbytes]


def _read_kv(ggml: Any, ctx: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(ggml.gguf_get_n_kv(ctx)):
        key = ggml.gguf_get_key(ctx, i).decode()
        kind = ggml.gguf_get_kv_type(ctx, i)
        if kind == _STRING:
            out[key] = ggml.gguf_get_val_str(ctx, i).decode("utf-8", "replace")
        elif kind == _ARRAY:
            out[key] = _ArrayLen(int(ggml.gguf_get_arr_n(ctx, i)))
        elif kind in _SCALAR_GETTERS:
            out[key] = getattr(ggml, _SCALAR_GETTERS[kind])(ctx, i)
    return out


def _read_tensors(ggml: Any, ctx: Any, meta: ctypes.c_void_p) -> dict[str, TensorInfo]:
    base = int(ggml.gguf_get_data_offset(ctx))
    out = {}
    for i in range(ggml.gguf_get_n_tensors(ctx)):
        name = ggml.gguf_get_tensor_name(ctx, i).decode()
        t = ggml.ggml_get_tensor(meta, name.encode())
        ne = tuple(int(t.contents.ne[d]) for d in range(ggml.ggml_n_dims(t)))
        out[name] = TensorInfo(name=name, type=int(ggml.gguf_get_tensor_type(ctx, i)), ne=ne,
                               offset=base + int(ggml.gguf_get_tensor_offset(ctx, i)),
                               nbytes=int(ggml.gguf_get_tensor_size(ctx, i)))
    return out


class _ArrayLen(int):
    """Stands for an array value: only its length is read (vocab size, merges count)."""
