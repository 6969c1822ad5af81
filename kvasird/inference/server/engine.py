"""The engine objects this node serves: stages and expert workers built from held units.

``Holdings.of(units)`` turns the market's units into the ranges the engine loads;
``Served.build`` loads them (blocking; run in a thread) on one ggml backend. ``run_short``
runs a short computation in place when nothing else holds its engine objects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from kvasird.compute.experts import ExpertShard, ExpertWorker
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import Backend
from kvasird.compute.hparams import HParams
from kvasird.compute.kvcache import KVSpec
from kvasird.compute.runtime import compute_threads
from kvasird.compute.stage import Stage, held_now
from kvasird.compute.weights import EXPERT_SUFFIXES, Weights, load_weights
from kvasird.inference.errors import Refusal
from kvasird.inference.tokenizer import Tokenizer, TokenizerError
from kvasird.model.manifest import Unit
from kvasird.model.names import human_name
from kvasird.model.slice import contiguous_runs

INLINE_TOKENS = 4
"""Steps (and expert batches) of at most this many rows may compute on the event loop's
thread (`run_short`)."""
T = TypeVar("T")

RemoteHook = Callable[[int, int, int], ExpertShard]
"""(layer, first, end) -> a shard computing those experts on other peers."""


@dataclass(frozen=True)
class Holdings:
    """The units of one model a node holds, as the ranges the engine loads."""

    head: bool = False
    """Token embedding, output norm and output matrix."""
    windows: tuple[tuple[int, int], ...] = ()
    """Contiguous layer runs [a, b) (dense paths)."""
    experts: tuple[tuple[int, int, int], ...] = ()
    """(layer, e0, e1) per layer: the span from the first to the last held expert. Loading
    the span (gaps included) keeps every advertised expert servable with one contiguous
    range, which is what a worker's graph indexes."""

    @classmethod
    def of(cls, units: Iterable[Unit]) -> Holdings:
        units = set(units)
        layers = sorted(u.layer for u in units if u.kind == "layer")
        by_layer: dict[int, list[int]] = {}
        for u in units:
            if u.kind == "expert":
                by_layer.setdefault(u.layer, []).append(u.expert)
        experts = tuple((layer, min(es), max(es) + 1) for layer, es in sorted(by_layer.items()))
        return cls(any(u.kind == "head" for u in units), tuple(contiguous_runs(layers)), experts)

    def expert_range(self, layer: int) -> tuple[int, int] | None:
        return next(((e0, e1) for lay, e0, e1 in self.experts if lay == layer), None)


class Served:
    """The engine objects for a Holdings: stages and expert workers on one backend."""

    def __init__(self, sources: list[Path], holdings: Holdings, backend: Backend,
                 hp: HParams) -> None:
        self.sources, self.holdings, self.backend, self.hp = sources, holdings, backend, hp
        self.label = human_name(GGUFFile(sources[0]).metadata, sources[0].name)
        self.embed: Stage | None = None
        self.head: Stage | None = None
        self.windows: dict[tuple[int, int], Stage] = {}
        self._parts: dict[tuple[int, int], Stage] = {}
        """Sub-ranges of windows that routes asked for (Stage.part), made once."""
        self.workers: dict[int, ExpertWorker] = {}
        """Layer -> the worker computing this node's held experts of it."""
        self.expert_first: dict[int, int] = {}
        """Layer -> global id of the first expert held (local ids count from here)."""
        self._extra: Weights | None = None
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def build(cls, sources: list[Path], holdings: Holdings, *, threads: int, kv_slots: int,
              remote: RemoteHook, kv_dtype: str = "f16") -> Served:
        """Load everything `holdings` names from the model's GGUF, or the slices holding
        those units (blocking)."""
        hp = HParams.from_gguf(GGUFFile(sources[0]))
        served = cls(sources, holdings, Backend(compute_threads(threads)), hp)
        try:
            served._load(KVSpec(n_slots=kv_slots, dtype=kv_dtype), remote)
        except BaseException:
            served.close()
            raise
        return served

    def _load(self, kv: KVSpec, remote: RemoteHook) -> None:
        hp, h, be = self.hp, self.holdings, self.backend
        positions = KVSpec(n_slots=1 << 20)  # embed/head stages hold no KV: positions only
        if h.head:
            self.embed = Stage.load(self.sources, (0, 0), embed=True, head=False, backend=be,
                                    kv=positions)
            self.head = Stage.load(self.sources, (hp.n_layer, hp.n_layer), embed=False, head=True,
                                   backend=be, kv=positions)
        in_window: set[int] = set()
        for a, b in h.windows:
            shards: dict[int, list[ExpertShard]] = {}
            ranges: dict[int, tuple[int, int]] = {}
            for layer in range(a, b) if hp.is_moe else ():
                held = h.expert_range(layer)
                if held == (0, hp.n_expert):
                    continue
                if held is not None:
                    ranges[layer] = held
                shards[layer] = [remote(layer, lo, hi) for lo, hi in _complement(held, hp.n_expert)]
            stage = Stage.load(self.sources, (a, b), embed=False, head=False, backend=be,
                               kv=kv, experts=shards,
                               expert_ranges=ranges)
            self.windows[(a, b)] = stage
            local = stage.local_worker()
            for layer in ranges:
                stage.set_experts(layer, [*shards[layer], local.shard(layer)])
            for layer, r in stage.weights.experts.items():
                self.workers[layer], self.expert_first[layer] = local, r.first
                in_window.add(layer)
        rest = {layer: (e0, e1) for layer, e0, e1 in h.experts if layer not in in_window}
        if rest:
            names = [f"blk.{layer}.{s}" for layer in rest for s in EXPERT_SUFFIXES]
            self._extra = load_weights(self.sources, be, names, rest)
            worker = ExpertWorker(self._extra, be)
            for layer, r in self._extra.experts.items():
                self.workers[layer], self.expert_first[layer] = worker, r.first

    @functools.cached_property
    def dispatches(self) -> bool:
        """Whether any stage here sends rows to expert shards (a step may then await)."""
        return any(st.dispatches for st in self.all_stages())

    def stages_for(self, first: int, end: int, embed: bool, head: bool) -> list[Stage]:
        """The chain of stages that computes one hop, or Refusal when we lack a part."""
        chain: list[Stage] = []
        if embed:
            if self.embed is None:
                raise Refusal("bad", "this node does not hold the head (embedding)")
            chain.append(self.embed)
        if first < end:
            chain.append(self.window(first, end))
        if head:
            if self.head is None:
                raise Refusal("bad", "this node does not hold the head (output)")
            chain.append(self.head)
        if not chain:
            raise Refusal("bad", "an empty hop computes nothing")
        return chain

    def window(self, first: int, end: int) -> Stage:
        """The stage computing layers [first, end): a held window, or a part of one (a
        route may enter a window past its start and leave it before its end, so that
        windows which overlap still chain)."""
        stage = self.windows.get((first, end))
        if stage is None:
            stage = self._parts.get((first, end))
        if stage is not None:
            return stage
        for (a, b), whole in self.windows.items():
            if a <= first and end <= b:
                stage = self._parts[(first, end)] = whole.part(first, end)
                return stage
        raise Refusal("bad", f"this node serves no layer window holding [{first}, {end}); "
                             f"it serves {sorted(self.windows)}")

    def all_stages(self) -> list[Stage]:
        return [st for st in (self.embed, self.head, *self.windows.values()) if st is not None]

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (what a grammar is compiled against at the head), read once
        from the first source that carries it: the whole file, or the head's slice."""
        if self._tokenizer is None:
            for source in self.sources:
                try:
                    self._tokenizer = Tokenizer.from_gguf(source)
                    break
                except TokenizerError:
                    continue
            else:
                raise Refusal("bad", "this node holds no part of the model that carries its "
                                     "tokenizer, so it cannot follow a grammar")
        return self._tokenizer

    def close(self) -> None:
        for stage in self.all_stages():
            stage.graphs.close()
            stage.kv.close()
            stage.weights.close()
        for worker in set(self.workers.values()):
            worker.close()
        if self._extra is not None:
            self._extra.close()
        self.backend.close()


def _complement(held: tuple[int, int] | None, n: int) -> list[tuple[int, int]]:
    if held is None:
        return [(0, n)]
    return [(lo, hi) for lo, hi in ((0, held[0]), (held[1], n)) if lo < hi]


async def run_short(holders: Sequence[Stage | ExpertWorker | Backend], short: bool,
                     fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in place when the work is `short` (a decode step of a few ms) and nothing
    else is computing on `holders`: handing it to a thread and back would add ~0.1 ms per
    hop, more on a busy machine. Otherwise in a worker thread, as long work must be."""
    if short:
        with held_now(holders) as held:
            if held:
                return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)

