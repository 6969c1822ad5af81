"""The manifest of a model and the model id that names it.

A manifest lists everything a node needs to check bytes it did not produce: the GGUF
metadata, and for each tensor its type, shape, offset, length and sha256. The three
stacked expert tensors of a MoE block (``blk.N.ffn_{gate,up,down}_exps``) also carry
one sha256 per expert slab, since expert e is the contiguous bytes ``data[e]``. Any
piece longer than ``chunk_size`` also lists the sha256 of each chunk, so transfers can
verify, resume and spread a big tensor over several holders one chunk at a time.

The model id is the sha256 of the manifest's canonical bytes (msgpack, maps with
sorted keys, values as gguffile's canonical form): two files with the same content
and layout have the same id, and a manifest fetched from a peer is checked against
the id before anything in it is used.

Units are what the market trades and nodes hold: ``layer:i`` (every tensor of block
i except its expert tensors), ``expert:i:e`` (slab e of block i's expert tensors)
and ``head`` (every tensor outside the blocks: token_embd, output_norm, output).
"""

from __future__ import annotations

import hashlib
import mmap
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import msgpack
from gguf import GGUFValueType

from kvasird.errors import ModelError
from kvasird.model.gguffile import (
    SCALAR_FORMATS,
    GGUFFormatError,
    read_header,
    tensor_nbytes,
)

FORMAT = 1
"""Version of the canonical manifest encoding; part of the hashed bytes."""
CHUNK_SIZE = 4 << 20
"""4 MiB: pieces longer than this are hashed (and transferred) chunk by chunk."""
MAX_MANIFEST = 256 << 20
"""Largest manifest accepted from a peer."""

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
"""Stacked expert tensors, one slab per expert along the last axis: the weights [.., .., E]
and, where the model has them (gpt-oss), their biases [.., E]."""


class ManifestError(ModelError):
    """A manifest is malformed, or does not match the model id it was fetched for."""


@dataclass(frozen=True, order=True)
class Unit:
    """A unit of holding: a layer window step, one expert of one layer, or the head."""

    kind: str
    """"layer", "expert" or "head"."""
    layer: int = -1
    """Block index (-1 for the head)."""
    expert: int = -1
    """Expert index within the block (-1 unless kind is "expert")."""

    def __str__(self) -> str:
        if self.kind == "layer":
            return f"layer:{self.layer}"
        if self.kind == "expert":
            return f"expert:{self.layer}:{self.expert}"
        return "head"

    @classmethod
    def parse(cls, text: str) -> Unit:
        parts = text.split(":")
        try:
            if parts == ["head"]:
                return HEAD
            if parts[0] == "layer" and len(parts) == 2:
                return cls("layer", int(parts[1]))
            if parts[0] == "expert" and len(parts) == 3:
                return cls("expert", int(parts[1]), int(parts[2]))
        except ValueError:
            pass
        raise ManifestError(f"bad unit {text!r}: write layer:I, expert:I:E or head")


HEAD = Unit("head")


@dataclass(frozen=True)
class Piece:
    """A run of bytes hashed on its own: a whole tensor, or one expert slab of one."""

    tensor: str
    """Name of the tensor it belongs to."""
    expert: int
    """Slab index for an expert tensor; -1 for a whole tensor."""
    start: int
    """Offset of the piece within the tensor's data."""
    length: int
    """Bytes."""
    sha256: bytes
    """sha256 of the piece's bytes; also its name in the content-addressed store."""
    chunks: tuple[bytes, ...]
    """sha256 of each chunk_size run of the piece; empty when the piece is one chunk."""
    unit: Unit
    """The unit that holds this piece."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.tensor, self.expert)

    def spans(self, chunk_size: int) -> list[tuple[int, int, bytes]]:
        """(offset, length, sha256) of each chunk: the granularity of verification."""
        if not self.chunks:
            return [(0, self.length, self.sha256)]
        return [
            (i * chunk_size, min(chunk_size, self.length - i * chunk_size), h)
            for i, h in enumerate(self.chunks)
        ]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the model."""

    name: str
    """GGUF tensor name."""
    ggml_type: int
    """GGMLQuantizationType value."""
    ne: tuple[int, ...]
    """Shape in ggml order."""
    offset: int
    """Offset within the original file's data section."""
    length: int
    """Bytes."""
    sha256: bytes
    """sha256 of all the tensor's bytes."""
    chunks: tuple[bytes, ...]
    """Chunk hashes of the whole tensor (non-expert tensors longer than a chunk)."""
    slabs: tuple[tuple[bytes, tuple[bytes, ...]], ...]
    """(sha256, chunk hashes) per expert slab; empty unless an expert tensor."""

    @property
    def layer(self) -> int:
        m = _BLOCK.match(self.name)
        return int(m.group(1)) if m else -1

    @property
    def is_expert(self) -> bool:
        return bool(self.slabs)

    @property
    def slab_length(self) -> int:
        return self.length // self.ne[-1]

    def pieces(self) -> list[Piece]:
        if not self.slabs:
            unit = Unit("layer", self.layer) if self.layer >= 0 else HEAD
            return [Piece(self.name, -1, 0, self.length, self.sha256, self.chunks, unit)]
        n = self.slab_length
        return [
            Piece(self.name, e, e * n, n, sha, chunks, Unit("expert", self.layer, e))
            for e, (sha, chunks) in enumerate(self.slabs)
        ]


@dataclass(frozen=True)
class Manifest:
    """A model's canonical description; ``model_id`` is the sha256 of ``raw``."""

    metadata: tuple[tuple[str, int, Any], ...]
    """(key, GGUFValueType, canonical value) in file order (see gguffile)."""
    tensors: tuple[TensorEntry, ...]
    """Tensors in file order."""
    alignment: int
    """Data alignment of the original file."""
    chunk_size: int
    """Chunk length used for chunk hashes."""
    raw: bytes = field(repr=False, compare=False)
    """The canonical encoding; what the model id hashes and what peers exchange."""

    @cached_property
    def model_id(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @classmethod
    def from_gguf(cls, path: Path, progress: Callable[[int, int], None] | None = None) -> Manifest:
        """Hash a GGUF file into its manifest (about 1 s per GB on one core);
        ``progress(done, total)`` is called after each tensor with the bytes hashed."""
        header = read_header(path)
        total, done, entries = sum(t.length for t in header.tensors), 0, []
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for t in header.tensors:
                    entries.append(
                        _hash_tensor(
                            view, header.data_offset, t.name, t.ggml_type, t.ne, t.offset, t.length
                        )
                    )
                    done += t.length
                    if progress is not None:
                        progress(done, total)
            finally:
                view.release()
        return cls.build(header.metadata, entries, header.alignment)

    @classmethod
    def build(
        cls,
        metadata: Iterable[tuple[str, int, Any]],
        tensors: Iterable[TensorEntry],
        alignment: int,
        chunk_size: int = CHUNK_SIZE,
    ) -> Manifest:
        metadata, tensors = tuple(metadata), tuple(tensors)
        doc = {
            "alignment": alignment,
            "chunk_size": chunk_size,
            "format": FORMAT,
            "metadata": [[k, t, _plain(v)] for k, t, v in metadata],
            "tensors": [_tensor_doc(t) for t in tensors],
        }
        raw = msgpack.packb(doc, use_bin_type=True)
        return cls(metadata, tensors, alignment, chunk_size, raw)

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray, model_id: str | None = None) -> Manifest:
        """Decode and validate manifest bytes, e.g. from a peer; checks them against model_id."""
        if model_id is not None and hashlib.sha256(raw).hexdigest() != model_id:
            raise ManifestError(
                f"manifest bytes do not hash to model id {model_id[:16]}…: "
                "the peer sent a different model; it is not used"
            )
        try:
            return _decode(raw)
        except (
            KeyError,
            TypeError,
            ValueError,
            GGUFFormatError,
            msgpack.ExtraData,
            msgpack.FormatError,
            msgpack.StackError,
        ) as exc:
            raise ManifestError(f"malformed manifest: {exc}") from None

    def meta(self, key: str, default: Any = None) -> Any:
        """A metadata value, strings decoded."""
        for k, _, v in self.metadata:
            if k == key:
                return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        return default

    @property
    def arch(self) -> str:
        return str(self.meta("general.architecture", "unknown"))

    @cached_property
    def n_layer(self) -> int:
        """Blocks of the trunk: those the tensors hold, less the multi-token-prediction
        blocks some files append (llama.cpp's `nextn_predict_layers`, counted in
        block_count), which no stage computes and so no unit holds."""
        held = 1 + max((t.layer for t in self.tensors), default=-1)
        blocks = self.meta(f"{self.arch}.block_count")
        draft = self.meta(f"{self.arch}.nextn_predict_layers", 0)
        if not isinstance(blocks, int) or not isinstance(draft, int):
            return held
        return max(0, min(held, blocks - draft))

    @cached_property
    def n_expert(self) -> int:
        return max((len(t.slabs) for t in self.tensors), default=0)

    @cached_property
    def _by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise ManifestError(f"model {self.model_id[:16]} has no tensor {name!r}") from None

    @cached_property
    def all_pieces(self) -> tuple[Piece, ...]:
        return tuple(p for t in self.tensors if t.layer < self.n_layer for p in t.pieces())

    @cached_property
    def _by_key(self) -> dict[tuple[str, int], Piece]:
        return {p.key: p for p in self.all_pieces}

    def piece(self, tensor: str, expert: int) -> Piece:
        """A tensor's piece: expert slab `expert`, or the whole tensor when expert is -1."""
        try:
            return self._by_key[(tensor, expert)]
        except KeyError:
            raise ManifestError(
                f"model {self.model_id[:16]} has no piece {expert} of tensor {tensor!r}"
            ) from None

    def pieces(self, units: Iterable[Unit] | None = None) -> list[Piece]:
        """The pieces of the given units (all pieces when None), in file order."""
        if units is None:
            return list(self.all_pieces)
        wanted = set(units)
        return [p for p in self.all_pieces if p.unit in wanted]

    @cached_property
    def unit_sizes(self) -> dict[Unit, int]:
        """Bytes per unit: what the market prices and a node budgets."""
        sizes: dict[Unit, int] = {}
        for p in self.all_pieces:
            sizes[p.unit] = sizes.get(p.unit, 0) + p.length
        return dict(sorted(sizes.items()))

    @property
    def total_bytes(self) -> int:
        return sum(p.length for p in self.all_pieces)


def _hash_tensor(
    view: memoryview,
    base: int,
    name: str,
    ggml_type: int,
    ne: tuple[int, ...],
    offset: int,
    length: int,
) -> TensorEntry:
    data = view[base + offset : base + offset + length]
    sha = hashlib.sha256(data).digest()
    if _EXPERT.match(name) and len(ne) in (2, 3):
        n = length // ne[-1]
        slabs = tuple(_hash_piece(data[e * n : (e + 1) * n]) for e in range(ne[-1]))
        return TensorEntry(name, ggml_type, ne, offset, length, sha, (), slabs)
    chunks = _chunk_hashes(data) if length > CHUNK_SIZE else ()
    return TensorEntry(name, ggml_type, ne, offset, length, sha, chunks, ())


def _hash_piece(data: memoryview) -> tuple[bytes, tuple[bytes, ...]]:
    return hashlib.sha256(data).digest(), (_chunk_hashes(data) if len(data) > CHUNK_SIZE else ())


def _chunk_hashes(data: memoryview) -> tuple[bytes, ...]:
    return tuple(
        hashlib.sha256(data[i : i + CHUNK_SIZE]).digest() for i in range(0, len(data), CHUNK_SIZE)
    )


def _plain(value: Any) -> Any:
    """Canonical metadata value → msgpack-ready value (arrays as [sub_type, items])."""
    if isinstance(value, tuple):
        sub, items = value
        return [sub, items if isinstance(items, bytes) else [_plain(i) for i in items]]
    return value


def _tensor_doc(t: TensorEntry) -> dict[str, Any]:
    return {
        "chunks": list(t.chunks),
        "length": t.length,
        "name": t.name,
        "ne": list(t.ne),
        "offset": t.offset,
        "sha256": t.sha256,
        "slabs": [[sha, list(chunks)] for sha, chunks in t.slabs],
        "type": t.ggml_type,
    }


def _decode(raw: bytes | bytearray) -> Manifest:
    doc = msgpack.unpackb(
        raw,
        raw=False,
        strict_map_key=True,
        max_bin_len=len(raw),
        max_str_len=len(raw),
        max_array_len=len(raw),
        max_map_len=64,
    )
    if doc["format"] != FORMAT:
        raise ValueError(f"manifest format {doc['format']} is not {FORMAT}: upgrade kvasird")
    chunk_size, alignment = int(doc["chunk_size"]), int(doc["alignment"])
    if chunk_size < 4096 or alignment < 1:
        raise ValueError("chunk_size or alignment out of range")
    metadata = [(_text(k), int(t), _canonical_value(int(t), v)) for k, t, v in doc["metadata"]]
    tensors = [_decode_tensor(d, chunk_size) for d in doc["tensors"]]
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError("two tensors share a name")
    manifest = Manifest.build(metadata, tensors, alignment, chunk_size)
    if manifest.raw != raw:
        raise ValueError("not in canonical form")
    return manifest


def _decode_tensor(d: dict[str, Any], chunk_size: int) -> TensorEntry:
    name, ggml_type = _text(d["name"]), int(d["type"])
    ne = tuple(int(n) for n in d["ne"])
    length = int(d["length"])
    if not 1 <= len(ne) <= 4 or min(ne) < 1 or length != tensor_nbytes(ggml_type, ne):
        raise ValueError(f"tensor {name}: length {length} does not match its type and shape")
    slabs = tuple((_digest(s), _chunks(c, length // ne[-1], chunk_size)) for s, c in d["slabs"])
    if slabs and (not _EXPERT.match(name) or len(ne) not in (2, 3) or len(slabs) != ne[-1]):
        raise ValueError(f"tensor {name}: slab hashes do not match its expert count")
    chunks = _chunks(d["chunks"], 0 if slabs else length, chunk_size)
    return TensorEntry(
        name, ggml_type, ne, int(d["offset"]), length, _digest(d["sha256"]), chunks, slabs
    )


def _chunks(hashes: list[Any], length: int, chunk_size: int) -> tuple[bytes, ...]:
    expected = -(-length // chunk_size) if length > chunk_size else 0
    if len(hashes) != expected:
        raise ValueError(f"{len(hashes)} chunk hashes for {length} bytes, expected {expected}")
    return tuple(_digest(h) for h in hashes)


def _digest(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) != 32:
        raise ValueError("a sha256 must be 32 bytes")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def _canonical_value(vtype: int, value: Any) -> Any:
    if vtype == GGUFValueType.ARRAY:
        sub, items = value
        if sub in SCALAR_FORMATS:
            if not isinstance(items, bytes):
                raise ValueError("numeric array items must be raw bytes")
            return (sub, items)
        return (sub, [_canonical_value(sub, i) for i in items])
    if vtype == GGUFValueType.STRING:
        if not isinstance(value, bytes):
            raise ValueError("metadata strings must be raw bytes")
        return value
    if vtype not in SCALAR_FORMATS:
        raise ValueError(f"unknown metadata type {vtype}")
    if not isinstance(value, int | float):
        raise ValueError("metadata scalar must be a number")
    return value
