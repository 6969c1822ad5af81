"""Slices: the part of a model one node computes, written as a mini-GGUF by byte copy.

Three shapes of slice (``SliceSpec``), each with a text form for the CLI and metadata:

    layers=A:B              ring window: every tensor of blocks A..B-1
    layers=A:B,no-experts   the same without the stacked expert tensors (experts live elsewhere)
    experts=L:E0:E1         experts E0..E1-1 of block L: the three expert tensors cut to those slabs
    head                    tensors outside the blocks: token_embd, output_norm, output

No tensor is ever dequantized: a window copies whole tensors, an expert range copies
the contiguous slabs ``data[E0:E1]`` of each stacked tensor (its last ne becomes E1-E0). The
mini-GGUF keeps the model's metadata (the tokenizer only in the head) under the original
architecture, so ggml's loader reads it, and adds ``kvasir.model_id`` and ``kvasir.slice``.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from kvasird.errors import ModelError
from kvasird.model.gguffile import SCALAR_FORMATS, read_header
from kvasird.model.manifest import HEAD, Manifest, Piece, TensorEntry, Unit

KEY_MODEL_ID = "kvasir.model_id"
KEY_SLICE = "kvasir.slice"

PieceReader = Callable[[Piece], "bytes | memoryview"]
"""Returns the bytes of one piece (from a full GGUF, the store, or a download)."""


class SliceError(ModelError):
    """A slice spec is malformed or out of range, or a slice file does not match its model."""


@dataclass(frozen=True)
class LayerWindow:
    """Blocks [start, stop) of the ring."""

    start: int
    """First block."""
    stop: int
    """One past the last block."""
    experts: bool = True
    """Include the blocks' stacked expert tensors."""

    def __str__(self) -> str:
        return f"layers={self.start}:{self.stop}" + ("" if self.experts else ",no-experts")


@dataclass(frozen=True)
class ExpertRange:
    """Experts [start, stop) of one block."""

    layer: int
    """Block index."""
    start: int
    """First expert."""
    stop: int
    """One past the last expert."""

    def __str__(self) -> str:
        return f"experts={self.layer}:{self.start}:{self.stop}"


@dataclass(frozen=True)
class HeadSlice:
    """Token embedding, output norm and output matrix."""

    def __str__(self) -> str:
        return "head"


SliceSpec = LayerWindow | ExpertRange | HeadSlice


def parse_spec(text: str) -> SliceSpec:
    what, _, rest = text.strip().partition("=")
    try:
        if what == "head" and not rest:
            return HeadSlice()
        if what == "layers":
            rng, _, flag = rest.partition(",")
            a, b = (int(x) for x in rng.split(":"))
            if flag in ("", "no-experts"):
                return LayerWindow(a, b, experts=not flag)
        if what == "experts":
            layer, e0, e1 = (int(x) for x in rest.split(":"))
            return ExpertRange(layer, e0, e1)
    except ValueError:
        pass
    raise SliceError(
        f"bad slice {text!r}: write layers=A:B, layers=A:B,no-experts, experts=L:E0:E1 or head"
    )


def units_of(manifest: Manifest, spec: SliceSpec) -> list[Unit]:
    """The units a slice consists of, after checking it fits the model."""
    _check(manifest, spec)
    if isinstance(spec, HeadSlice):
        return [HEAD]
    if isinstance(spec, ExpertRange):
        return [Unit("expert", spec.layer, e) for e in range(spec.start, spec.stop)]
    units = [Unit("layer", i) for i in range(spec.start, spec.stop)]
    if spec.experts:
        units += [
            Unit("expert", i, e)
            for i in range(spec.start, spec.stop)
            for e in range(_experts_in(manifest, i))
        ]
    return units


def slice_tensors(manifest: Manifest, spec: SliceSpec) -> list[tuple[TensorEntry, list[Piece]]]:
    """Each tensor of the slice with the pieces that make up its bytes, in file order."""
    wanted = set(units_of(manifest, spec))
    out = []
    for t in manifest.tensors:
        pieces = [p for p in t.pieces() if p.unit in wanted]
        if pieces:
            out.append((t, pieces))
    return out


def write_slice(manifest: Manifest, spec: SliceSpec, path: Path, read_piece: PieceReader) -> Path:
    """Write the slice as a mini-GGUF, one tensor in memory at a time."""
    tensors = slice_tensors(manifest, spec)
    writer = GGUFWriter(str(path), manifest.arch)
    if manifest.alignment != 32:
        writer.add_custom_alignment(manifest.alignment)
    for key, vtype, value in manifest.metadata:
        if _keep(key, spec):
            _add_metadata(writer, key, vtype, value)
    writer.add_string(KEY_MODEL_ID, manifest.model_id)
    writer.add_string(KEY_SLICE, str(spec))
    for t, pieces in tensors:
        ne = (*t.ne[:-1], len(pieces)) if t.is_expert else t.ne
        nbytes = sum(p.length for p in pieces)
        writer.add_tensor_info(
            t.name,
            _byte_shape(t.ggml_type, ne),
            np.dtype(np.uint8),
            nbytes,
            raw_dtype=GGMLQuantizationType(t.ggml_type),
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, pieces in tensors:
        parts = [np.frombuffer(read_piece(p), dtype=np.uint8) for p in pieces]
        writer.write_tensor_data(parts[0] if len(parts) == 1 else np.concatenate(parts))
    writer.close()
    return path


@dataclass(frozen=True)
class SliceFile:
    """A mini-GGUF slice as read back from disk."""

    model_id: str
    """The model it was cut from."""
    spec: SliceSpec
    """Which part of the model it holds."""
    tensors: dict[str, bytes]
    """Tensor bytes by name."""


def read_slice(path: Path) -> SliceFile:
    header = read_header(path)
    meta = {k: v for k, _, v in header.metadata}
    try:
        model_id = meta[KEY_MODEL_ID].decode()
        spec = parse_spec(meta[KEY_SLICE].decode())
    except (KeyError, AttributeError, UnicodeDecodeError):
        raise SliceError(f"{path} is a GGUF but not a kvasir slice (no {KEY_MODEL_ID})") from None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        base = header.data_offset
        tensors = {t.name: mm[base + t.offset : base + t.offset + t.length] for t in header.tensors}
    return SliceFile(model_id, spec, tensors)


def verify_slice(path: Path, manifest: Manifest) -> SliceFile:
    """Read a slice and check every piece of it against the manifest."""
    got = read_slice(path)
    if got.model_id != manifest.model_id:
        raise SliceError(
            f"{path} belongs to model {got.model_id[:16]}, not {manifest.model_id[:16]}"
        )
    expected = slice_tensors(manifest, got.spec)
    if sorted(got.tensors) != sorted(t.name for t, _ in expected):
        raise SliceError(f"{path} does not hold the tensors of {got.spec}: delete it and re-slice")
    for t, pieces in expected:
        data, pos = memoryview(got.tensors[t.name]), 0
        for p in pieces:
            if hashlib.sha256(data[pos : pos + p.length]).digest() != p.sha256:
                raise SliceError(
                    f"{path}: {t.name} piece {p.expert} is corrupt: delete it and re-slice"
                )
            pos += p.length
        if pos != len(data):
            raise SliceError(f"{path}: {t.name} has {len(data)} bytes, expected {pos}")
    return got


@contextmanager
def gguf_pieces(path: Path, manifest: Manifest) -> Iterator[PieceReader]:
    """Read pieces straight out of the full GGUF a manifest was made from (zero copy)."""
    header = read_header(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)

        def read(p: Piece) -> memoryview:
            start = header.data_offset + manifest.tensor(p.tensor).offset + p.start
            return view[start : start + p.length]

        try:
            yield read
        finally:
            view.release()


def _check(manifest: Manifest, spec: SliceSpec) -> None:
    if isinstance(spec, LayerWindow) and not 0 <= spec.start < spec.stop <= manifest.n_layer:
        raise SliceError(f"{spec}: the model has blocks 0..{manifest.n_layer - 1}")
    if isinstance(spec, ExpertRange):
        n = _experts_in(manifest, spec.layer) if 0 <= spec.layer < manifest.n_layer else 0
        if not n:
            raise SliceError(f"{spec}: block {spec.layer} has no expert tensors")
        if not 0 <= spec.start < spec.stop <= n:
            raise SliceError(f"{spec}: block {spec.layer} has experts 0..{n - 1}")


def _experts_in(manifest: Manifest, layer: int) -> int:
    return max((len(t.slabs) for t in manifest.tensors if t.layer == layer), default=0)


def _keep(key: str, spec: SliceSpec) -> bool:
    if key in ("general.architecture", "general.alignment"):
        return False  # the writer sets both itself
    return isinstance(spec, HeadSlice) or not key.startswith("tokenizer.")


def _add_metadata(writer: GGUFWriter, key: str, vtype: int, value: object) -> None:
    if vtype != GGUFValueType.ARRAY:
        writer.add_key_value(key, value, GGUFValueType(vtype))
        return
    sub: int = value[0]  # type: ignore[index]
    items: Any = value[1]  # type: ignore[index]
    if isinstance(items, bytes):
        items = np.frombuffer(items, dtype="<" + SCALAR_FORMATS[sub]).tolist()
    elif sub == GGUFValueType.ARRAY:
        raise SliceError(f"metadata {key} is an array of arrays, which slices cannot carry yet")
    if items:  # gguf-py cannot write an empty array; an empty array says nothing anyway
        writer.add_key_value(key, items, GGUFValueType.ARRAY, GGUFValueType(sub))


def _byte_shape(ggml_type: int, ne: tuple[int, ...]) -> tuple[int, ...]:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return (*reversed(ne[1:]), ne[0] // block * type_size)


def contiguous_runs(values: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted integers as half-open runs: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    out: list[tuple[int, int]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1] = (out[-1][0], v + 1)
        else:
            out.append((v, v + 1))
    return out
