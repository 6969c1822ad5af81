"""Load chosen tensors of a GGUF (a whole model or a slice mini-GGUF) into a backend buffer.

A node holds only its units: a layer window, expert ranges, the head. The loader is
told *by tensor name* what to load, so it serves a full GGUF and a slice alike. For
3-D expert tensors it is also told the expert range held: from a full file, or from a
slice whose range covers it, it copies just that range's slab (expert e's bytes are one
contiguous block). A node may hold several ranges of one layer, each in a slice of its
own: the slice that covers the requested range is the one read. Inside the engine experts
are addressed by *local* id, 0 .. e1-e0.

On a CPU whose kernels read them repacked (Q4_0 and Q4_K on AVX2: graph.repack_buffer_type)
the matrices of those types go into a buffer of their own that stores them so, as
llama.cpp's loader does: its kernels then compute our logits, and prefill runs at its
speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvasird.compute.errors import WeightsError
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import (
    Backend,
    Tensor,
    TensorArena,
    repack_buffer_type,
    repackable,
    set_bytes,
)
from kvasird.compute.hparams import HParams
from kvasird.compute.shapes import check_tensors
from kvasird.model.slice import KEY_SLICE, parse_spec
from kvasird.model.slice import ExpertRange as SliceExperts

EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
EXPERT_BIASES = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")
"""gpt-oss's experts' biases: loaded with their weights wherever a source holds them."""
_STACKED = EXPERT_SUFFIXES + EXPERT_BIASES
"""Per-expert tensors, stacked along their last ggml dimension: one slab per expert."""


@dataclass(frozen=True)
class ExpertRange:
    """Experts [first, end) of one layer, held as local ids 0 .. end-first."""

    first: int
    """Global id of local expert 0."""
    end: int
    """One past the last global id held."""

    @property
    def count(self) -> int:
        return self.end - self.first


@dataclass
class Weights:
    """Tensors resident in one backend buffer, by GGUF name, plus the model's hparams."""

    hparams: HParams
    """Hyper-parameters of the whole model (from the file's metadata)."""
    source: Path
    """File the tensors came from."""
    arena: TensorArena
    """The ggml context and buffer that own the tensors."""
    experts: dict[int, ExpertRange] = field(default_factory=dict)
    """Expert range held per layer (only layers whose expert tensors were loaded)."""
    packed: TensorArena | None = None
    """The matrices held repacked for the CPU's kernels (graph.repack_buffer_type)."""

    def has(self, name: str) -> bool:
        return name in self.arena.tensors or (
            self.packed is not None and name in self.packed.tensors
        )

    def get(self, name: str) -> Tensor:
        if self.packed is not None and name in self.packed.tensors:
            return self.packed.tensors[name]
        try:
            return self.arena.tensors[name]
        except KeyError:
            raise WeightsError(f"tensor {name!r} was not loaded from {self.source}") from None

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes + (self.packed.nbytes if self.packed is not None else 0)

    def close(self) -> None:
        self.arena.close()
        if self.packed is not None:
            self.packed.close()


Source = str | Path | GGUFFile


def open_sources(sources: Source | Sequence[Source]) -> list[GGUFFile]:
    """One GGUF or several (a node's slices: window, head, expert ranges), opened."""
    items = [sources] if isinstance(sources, str | Path | GGUFFile) else list(sources)
    if not items:
        raise WeightsError("no weights file given")
    return [s if isinstance(s, GGUFFile) else GGUFFile(s) for s in items]


def slice_expert_ranges(files: Sequence[GGUFFile]) -> dict[int, tuple[int, int]]:
    """Expert ranges recorded by kvasird.model.slice in `kvasir.slice` ("experts=L:E0:E1")."""
    return {r[0]: r[1:] for r in map(_slice_experts, files) if r is not None}


def _slice_experts(f: GGUFFile) -> tuple[int, int, int] | None:
    """(layer, e0, e1) of a slice holding one layer's experts [e0, e1), else None."""
    text = f.get(KEY_SLICE)
    if isinstance(text, str) and text.startswith("experts="):
        spec = parse_spec(text)
        if isinstance(spec, SliceExperts):
            return spec.layer, spec.start, spec.stop
    return None


def load_weights(
    sources: Source | Sequence[Source],
    backend: Backend,
    names: Iterable[str] | None = None,
    experts: Mapping[int, tuple[int, int]] | None = None,
) -> Weights:
    """Load `names` (default: every tensor) from the first source holding each.

    `experts` maps layer -> [e0, e1) held; ranges recorded in slice files are added.
    """
    files = open_sources(sources)
    hp = HParams.from_gguf(files[0])
    given = {**slice_expert_ranges(files), **(experts or {})}
    ranges = {int(layer): ExpertRange(*map(int, r)) for layer, r in given.items()}
    where: dict[str, tuple[GGUFFile, int | None]] = {}
    for f in files:
        sliced = _slice_experts(f)
        for n in f.tensors:
            if n in where:
                continue
            if n.endswith(_STACKED) and sliced is not None:
                layer, e0, e1 = sliced
                r = ranges.get(layer)
                if r is not None and not e0 <= r.first < r.end <= e1:
                    continue  # another range of the layer's experts: another slice's
                where[n] = f, e0
            else:
                where[n] = f, None
    wanted = list(where) if names is None else list(dict.fromkeys(names))
    biases = [n.removesuffix("weight") + "bias" for n in wanted if n.endswith(EXPERT_SUFFIXES)]
    wanted += [n for n in biases if n in where and n not in wanted]
    missing = [n for n in wanted if n not in where]
    if missing:
        raise WeightsError(
            f"{', '.join(str(f.path) for f in files)} hold no tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + _range_hint(missing[0], ranges)
        )
    for f in files:
        check_tensors(hp, f.tensors, f.path, _slice_experts(f))
    plan = [_plan(*where[name], hp, name, ranges) for name in wanted]
    packs = {
        name for name, type_, ne, _, _ in plan if backend.cpu and repackable(name, type_, ne)
    }  # the CPU's kernels' layout
    arena, packed = TensorArena(len(plan) - len(packs)), TensorArena(len(packs))
    try:
        for name, type_, ne, _, _ in plan:
            (packed if name in packs else arena).new(name, type_, ne)
        if arena.tensors:
            arena.allocate(backend)
        if packs:
            packed.allocate(backend, repack_buffer_type())
            if unpacked := [n for n in packs if not packed.tensors[n].contents.extra]:
                raise WeightsError(f"ggml did not take {unpacked[0]} for repacking")  # our rule
        for name, _, _, start, size in plan:  # repacking: one whole tensor a call
            t = (packed if name in packs else arena).tensors[name]
            set_bytes(t, where[name][0].data(name)[start : start + size])
    except BaseException:
        arena.close()
        packed.close()
        raise
    held: dict[int, ExpertRange] = {}
    for name, _, ne, _, _ in plan:
        if name.endswith(_STACKED):
            layer = int(name.split(".")[1])
            held[layer] = ranges.get(layer, ExpertRange(0, ne[-1]))
    return Weights(hparams=hp, source=files[0].path, arena=arena, experts=held, packed=packed)


def _range_hint(name: str, ranges: Mapping[int, ExpertRange]) -> str:
    if not name.endswith(_STACKED):
        return ""
    r = ranges.get(int(name.split(".")[1]))
    return f" for experts [{r.first}, {r.end})" if r is not None else ""


def _plan(
    f: GGUFFile, file_first: int | None, hp: HParams, name: str, ranges: Mapping[int, ExpertRange]
):
    """(name, type, ne, byte start, byte size) of what to copy for one tensor; a recorded
    slice's experts are global ids from ``file_first`` on, another file's are the whole
    layer's or, fewer, the requested range's."""
    info = f.info(name)
    if not name.endswith(_STACKED):
        return name, info.type, info.ne, 0, info.nbytes
    layer = int(name.split(".")[1])
    n_file = info.ne[-1]
    r = ranges.get(layer)
    if file_first is None:
        file_first = 0 if r is None or n_file == hp.n_expert else r.first
    r = r or ExpertRange(file_first, file_first + n_file)
    if not 0 <= r.first < r.end <= hp.n_expert:
        raise WeightsError(
            f"expert range [{r.first}, {r.end}) of layer {layer} is outside 0..{hp.n_expert}"
        )
    if not file_first <= r.first < r.end <= file_first + n_file:
        raise WeightsError(
            f"{f.path}: {name} holds experts [{file_first}, "
            f"{file_first + n_file}), not the requested [{r.first}, {r.end})"
        )
    if n_file == r.count:
        return name, info.type, info.ne, 0, info.nbytes
    slab = info.nbytes // n_file
    return (
        name,
        info.type,
        (*info.ne[:-1], r.count),
        (r.first - file_first) * slab,
        r.count * slab,
    )
