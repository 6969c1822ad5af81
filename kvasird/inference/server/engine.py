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
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.runtime import compute_threads
from kvasird.compute.stage import Stage, held_now
from kvasird.compute.weights import EXPERT_SUFFIXES, Weights, load_weights
from kvasird.inference.errors import Refusal
from kvasird.model.manifest import Unit
from kvasird.model.slice import contiguous_runs
from kvasird.text.tokenizer import Tokenizer, TokenizerError

INLINE_TOKENS = 4
"""Steps (and expert batches) of at most this many rows may compute on the event loop's
thread (`run_short`)."""
T = TypeVar("T")

RemoteHook = Callable[[int, int, int], ExpertShard]
"""(layer, first, end) -> a shard computing those experts on other peers."""
Choose = Callable[[Stage, tuple[int, ...], int], frozenset[int]]
"""(stage, its layers whose experts it holds and may send out, rows) -> those to send out
(Stage.choose)."""


@dataclass(frozen=True)
class Holdings:
    """The units of one model a node holds, as the ranges the engine loads."""

    head: bool = False
    """Token embedding, output norm and output matrix."""
    windows: tuple[tuple[int, int], ...] = ()
    """Contiguous layer runs [a, b) (dense paths)."""
    experts: tuple[tuple[int, int, int], ...] = ()
    """(layer, e0, e1) for each contiguous run of held experts: a layer may have several
    (the market takes experts one by one, hot ones wherever they are), each loaded as a
    range of its own from the slice that holds it."""

    @classmethod
    def of(cls, units: Iterable[Unit]) -> Holdings:
        units = set(units)
        layers = sorted(u.layer for u in units if u.kind == "layer")
        by_layer: dict[int, list[int]] = {}
        for u in units:
            if u.kind == "expert":
                by_layer.setdefault(u.layer, []).append(u.expert)
        experts = tuple(
            (layer, a, b)
            for layer, es in sorted(by_layer.items())
            for a, b in contiguous_runs(sorted(es))
        )
        return cls(any(u.kind == "head" for u in units), tuple(contiguous_runs(layers)), experts)

    def expert_ranges(self, layer: int) -> list[tuple[int, int]]:
        return [(e0, e1) for lay, e0, e1 in self.experts if lay == layer]


@dataclass(frozen=True)
class Run:
    """One contiguous range of a layer's experts held here, and the worker computing it."""

    first: int
    end: int
    worker: ExpertWorker


class Served:
    """The engine objects for a Holdings: stages and expert workers on one backend."""

    def __init__(
        self, sources: list[Path], holdings: Holdings, backend: Backend, hp: HParams
    ) -> None:
        self.sources, self.holdings, self.backend, self.hp = sources, holdings, backend, hp
        self.embed: Stage | None = None
        self.head: Stage | None = None
        self.windows: dict[tuple[int, int], Stage] = {}
        self._parts: dict[tuple[int, int], Stage] = {}
        """Sub-ranges of windows that routes asked for (Stage.part), made once."""
        self.runs: dict[int, list[Run]] = {}
        """Layer -> the ranges of its experts held here, each with its worker (local ids of
        a worker count from its range's first expert)."""
        self._extra: list[Weights] = []
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def build(
        cls,
        sources: list[Path],
        holdings: Holdings,
        *,
        threads: int,
        kv_slots: int,
        remote: RemoteHook,
        choose: Choose | None = None,
        kv_dtype: str = "f16",
        state_slots: int = 8,
        window_sessions: int = 8,
    ) -> Served:
        """Load everything `holdings` names from the model's GGUF, or the slices holding
        those units (blocking). With `choose`, a window's layer whose experts are all held
        here (a fallback replica) is also offered to the peers holding them, in the steps
        `choose` picks."""
        hp = HParams.from_gguf(GGUFFile(sources[0]))
        served = cls(sources, holdings, Backend(compute_threads(threads)), hp)
        try:
            served._load(
                KVSpec(
                    n_slots=kv_slots,
                    dtype=kv_dtype,
                    state_slots=state_slots,
                    window_sessions=window_sessions,
                ),
                remote,
                choose,
            )
        except BaseException:
            served.close()
            raise
        return served

    def _load(self, kv: KVSpec, remote: RemoteHook, choose: Choose | None) -> None:
        hp, h, be = self.hp, self.holdings, self.backend
        positions = KVSpec(n_slots=1 << 20)  # embed/head stages hold no KV: positions only
        if h.head:
            self.embed = Stage.load(
                self.sources, (0, 0), embed=True, head=False, backend=be, kv=positions
            )
            self.head = Stage.load(
                self.sources,
                (hp.n_layer, hp.n_layer),
                embed=False,
                head=True,
                backend=be,
                kv=positions,
            )
        extra: list[tuple[int, int, int]] = []
        for a, b in h.windows:
            shards: dict[int, list[ExpertShard]] = {}
            ranges: dict[int, tuple[int, int]] = {}
            whole: list[int] = []
            for layer in range(a, b) if hp.is_moe else ():
                held = h.expert_ranges(layer)
                if held == [(0, hp.n_expert)]:
                    whole.append(layer)
                    continue
                if held:  # the stage loads the largest, other workers the rest
                    ranges[layer] = max(held, key=lambda r: r[1] - r[0])
                    extra += [(layer, *r) for r in held if r != ranges[layer]]
                shards[layer] = [remote(layer, lo, hi) for lo, hi in _complement(held, hp.n_expert)]
            stage = Stage.load(
                self.sources,
                (a, b),
                embed=False,
                head=False,
                backend=be,
                kv=kv,
                experts=shards,
                expert_ranges=ranges,
            )
            self.windows[(a, b)] = stage
            if choose is not None and whole:
                for layer in whole:
                    stage.offer(layer, [remote(layer, 0, hp.n_expert)])
                stage.choose = choose
            local = stage.local_worker()
            for layer, r in stage.weights.experts.items():
                self.runs.setdefault(layer, []).append(Run(r.first, r.end, local))
        in_window = {layer for a, b in h.windows for layer in range(a, b)}
        extra += [(layer, e0, e1) for layer, e0, e1 in h.experts if layer not in in_window]
        # one load per "tier": the k-th extra range of every layer (a load holds one range
        # of a layer)
        while extra:
            tier = {layer: (e0, e1) for layer, e0, e1 in reversed(extra)}
            extra = [x for x in extra if tier[x[0]] != x[1:]]
            names = [f"blk.{layer}.{s}" for layer in tier for s in EXPERT_SUFFIXES]
            weights = load_weights(self.sources, be, names, tier)
            self._extra.append(weights)
            worker = ExpertWorker(weights, be)
            for layer, r in weights.experts.items():
                self.runs.setdefault(layer, []).append(Run(r.first, r.end, worker))
        for layer, stage in ((lay, st) for st in self.windows.values() for lay in st.shards):
            own = [run.worker.shard(layer) for run in self.runs.get(layer, ())]
            if own:
                stage.set_experts(layer, [*stage.shards[layer], *own])
        for runs in self.runs.values():
            runs.sort(key=lambda run: run.first)

    def run_of(self, layer: int, expert: int) -> Run | None:
        """The held range of ``layer``'s experts that holds ``expert``, if any."""
        return next((r for r in self.runs.get(layer, ()) if r.first <= expert < r.end), None)

    @functools.cached_property
    def dispatches(self) -> bool:
        """Whether any stage here sends rows to expert shards (a step may then await); a
        stage's offered layers only in the steps that send them out."""
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
        raise Refusal(
            "bad",
            f"this node serves no layer window holding [{first}, {end}); "
            f"it serves {sorted(self.windows)}",
        )

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
                raise Refusal(
                    "bad",
                    "this node holds no part of the model that carries its "
                    "tokenizer, so it cannot follow a grammar",
                )
        return self._tokenizer

    def close(self) -> None:
        for stage in self.all_stages():
            stage.graphs.close()
            stage.kv.close()
            stage.weights.close()
        for worker in {run.worker for runs in self.runs.values() for run in runs}:
            worker.close()
        for weights in self._extra:
            weights.close()
        self.backend.close()


def _complement(held: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The ranges of [0, n) outside the sorted, disjoint ``held``."""
    out, e = [], 0
    for lo, hi in sorted(held):
        if e < lo:
            out.append((e, lo))
        e = hi
    return out + [(e, n)] if e < n else out


async def run_short(
    holders: Sequence[Stage | ExpertWorker | Backend], short: bool, fn: Callable[..., T], *args: Any
) -> T:
    """fn(*args) in place when the work is `short` (a decode step of a few ms) and nothing
    else is computing on `holders`: handing it to a thread and back would add to every hop
    (see bench/bench_swarm.py's per-hop breakdown). Otherwise in a worker thread, as long
    work must be."""
    if short:
        with held_now(holders) as held:
            if held:
                return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)
