"""Expert FFNs: the worker's pure function, and the stage's split/dispatch/combine around it.

Router authority: the stage that owns a MoE layer's dense path picks the experts and
their weights. It then sends each worker holding a range `[first, end)` only the rows
routed there, with *local* ids (global - first), and combines what comes back:

    stage: ids [T, k] global ──split_by_shard──▶ worker(layer, rows [m, E], sel [m, n] local)
                                                      │ one ggml call per batch
    stage: resid + Σ_k w_k · y_k ◀──scatter── out [m, n, E]

A token whose k experts fall partly in a range sends that range one row, with its
in-range ids padded (by repeating one of them) to the batch's widest row; padded
outputs are dropped. The combine sums in slot order, as the fused graph does, so a
split computation equals the local one to float rounding.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvasird.compute.blocks import Blocks
from kvasird.compute.errors import ComputeError, InputError
from kvasird.compute.graph import F32, I32, Backend, Builder, GraphCache
from kvasird.compute.steps import Steps, drive
from kvasird.compute.weights import ExpertRange, Weights

ExpertDispatch = Callable[[int, np.ndarray, np.ndarray], np.ndarray]
"""(layer, rows [m, n_embd] float32, local ids [m, n_used]) -> outputs [m, n_used, n_embd]."""

MAX_BATCH = 8192
"""Most rows one worker call accepts; a larger batch is the caller's to split."""


@dataclass(frozen=True)
class ExpertShard:
    """Who computes experts [first, end) of a layer: a local worker or a remote hook."""

    first: int
    """First global expert id of the range."""
    end: int
    """One past the last global id."""
    call: ExpertDispatch
    """Computes rows for local ids 0 .. end-first."""
    acall: Callable[[int, np.ndarray, np.ndarray], Awaitable[np.ndarray]] | None = None
    """The same, awaitable (a remote shard called from the event loop); None for local
    workers, which compute in place."""


def _bucket(n: int) -> int:
    """Batch sizes a graph is built for: powers of two to 512, then multiples of 512."""
    return 1 << (n - 1).bit_length() if n <= 512 else -(-n // 512) * 512


class ExpertWorker:
    """Runs held experts for any batch of rows: one cached ggml graph per (layer, batch bucket)."""

    def __init__(self, weights: Weights, backend: Backend, graph_capacity: int = 32) -> None:
        self.weights = weights
        self.hp = weights.hparams
        self.graphs = GraphCache(backend, graph_capacity)
        self._lock = threading.RLock()
        self.locks = (self._lock, backend.lock)
        """What a call holds while it computes (for `stage.held_now`)."""

    def held(self, layer: int) -> ExpertRange:
        r = self.weights.experts.get(layer)
        if r is None:
            raise InputError(f"this worker holds no experts of layer {layer}")
        return r

    def shard(self, layer: int) -> ExpertShard:
        r = self.held(layer)
        return ExpertShard(r.first, r.end, self)

    def __call__(self, layer: int, cur: np.ndarray, sel: np.ndarray) -> np.ndarray:
        cur, sel = self.validate(layer, cur, sel)
        n, n_used = sel.shape
        size = _bucket(n)
        x = np.zeros((size, self.hp.n_embd), np.float32)
        x[:n] = cur
        ids = np.zeros((size, n_used), np.int32)
        ids[:n] = sel
        with self._lock:
            graph = self.graphs.get((layer, size, n_used), lambda: self._build(layer, size, n_used))
            out = graph.run({"cur": x, "ids": ids})["out"]
        return out.reshape(size, n_used, self.hp.n_embd)[:n]

    def validate(
        self, layer: int, cur: np.ndarray, sel: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Everything ggml would assert on or segfault over, checked here first."""
        r = self.held(layer)
        cur, sel = np.asarray(cur), np.asarray(sel)
        if cur.ndim != 2 or cur.shape[1] != self.hp.n_embd or cur.dtype.kind != "f":
            raise InputError(
                f"rows must be float [n_tokens, {self.hp.n_embd}], got "
                f"{cur.dtype} {list(cur.shape)}"
            )
        if sel.ndim != 2 or sel.shape[0] != cur.shape[0] or sel.dtype.kind not in "iu":
            raise InputError(
                f"expert ids must be integer [{cur.shape[0]}, n_used], got "
                f"{sel.dtype} {list(sel.shape)}"
            )
        if not 1 <= cur.shape[0] <= MAX_BATCH:
            raise InputError(f"a batch holds 1..{MAX_BATCH} rows, got {cur.shape[0]}")
        if not 1 <= sel.shape[1] <= self.hp.n_expert_used:
            raise InputError(f"n_used must be 1..{self.hp.n_expert_used}, got {sel.shape[1]}")
        if sel.min() < 0 or sel.max() >= r.count:
            bad = int(sel.max() if sel.max() >= r.count else sel.min())
            raise InputError(
                f"local expert id {bad} is outside 0..{r.count - 1} "
                f"(this worker holds experts [{r.first}, {r.end}) of layer {layer})"
            )
        return np.ascontiguousarray(cur, np.float32), sel.astype(np.int32)

    def _build(self, layer: int, size: int, n_used: int):
        def build(b: Builder) -> dict:
            cur = b.input("cur", F32, self.hp.n_embd, size)
            ids = b.input("ids", I32, n_used, size)
            blocks = Blocks(b, self.weights, None, size, 0)
            return {"out": blocks.experts(layer, cur, ids)}

        return build

    def close(self) -> None:
        self.graphs.close()


def check_shards(
    layer: int, shards: Sequence[ExpertShard], n_expert: int
) -> tuple[ExpertShard, ...]:
    """Shards sorted by range; they must not overlap and must stay within the layer's experts."""
    ordered = tuple(sorted(shards, key=lambda s: s.first))
    end = 0
    for s in ordered:
        if not 0 <= s.first < s.end <= n_expert or s.first < end:
            raise ComputeError(
                f"expert shards of layer {layer} overlap or leave 0..{n_expert}: "
                f"{[(x.first, x.end) for x in ordered]}"
            )
        end = s.end
    return ordered


def dispatch(
    layer: int, cur: np.ndarray, ids: np.ndarray, shards: Sequence[ExpertShard]
) -> np.ndarray:
    """Expert outputs [T, k, n_embd] for global `ids` [T, k], each range from its shard."""
    return drive(
        dispatch_steps(layer, cur, ids, shards), lambda need: need[0].call(layer, need[1], need[2])
    )


def dispatch_steps(
    layer: int, cur: np.ndarray, ids: np.ndarray, shards: Sequence[ExpertShard]
) -> Steps[np.ndarray]:
    """dispatch as steps (compute.steps): yields (shard, rows, shard-local ids) for each
    shard with work, is sent that shard's outputs, returns the assembled [T, k, n_embd].
    Where shards overlap, an id goes to the first that holds it (a stage's cached experts
    before the remote range that also holds them)."""
    if ids.shape[0] == 1:
        return (yield from _dispatch_one_row(layer, cur, ids, shards))
    y = np.empty((ids.shape[0], ids.shape[1], cur.shape[1]), np.float32)
    done = np.zeros(ids.shape, bool)
    for s in shards:
        inside = (ids >= s.first) & (ids < s.end) & ~done
        rows = np.flatnonzero(inside.any(axis=1))
        if rows.size == 0:
            continue
        sel, slot = _pack(ids[rows] - s.first, inside[rows])
        out = np.asarray((yield s, cur[rows], sel), np.float32)
        want = (rows.size, sel.shape[1], cur.shape[1])
        if out.shape != want:
            raise ComputeError(
                f"expert shard [{s.first}, {s.end}) of layer {layer} returned shape "
                f"{list(out.shape)}, expected {list(want)}"
            )
        r, j = np.nonzero(inside[rows])
        y[rows[r], j] = out[r, slot[r, j]]
        done[rows[r], j] = True
    if not done.all():
        t, j = np.argwhere(~done)[0]
        raise ComputeError(f"no shard holds expert {int(ids[t, j])} of layer {layer}")
    return y


def _dispatch_one_row(
    layer: int, cur: np.ndarray, ids: np.ndarray, shards: Sequence[ExpertShard]
) -> Steps[np.ndarray]:
    """dispatch_steps for a decode step's single row, in plain Python: the same requests
    (each shard's ids in slot order), without the ~15 numpy calls per shard that the
    general path spends on a row (a stage with remote experts runs this up to three times
    per MoE layer and token)."""
    row = ids[0].tolist()
    y = np.empty((1, len(row), cur.shape[1]), np.float32)
    done = [False] * len(row)
    for s in shards:
        cols = [j for j, g in enumerate(row) if s.first <= g < s.end and not done[j]]
        if not cols:
            continue
        sel = np.array([[row[j] - s.first for j in cols]], np.int32)
        out = np.asarray((yield s, cur, sel), np.float32)
        if out.shape != (1, len(cols), cur.shape[1]):
            raise ComputeError(
                f"expert shard [{s.first}, {s.end}) of layer {layer} returned shape "
                f"{list(out.shape)}, expected {[1, len(cols), cur.shape[1]]}"
            )
        for slot, j in enumerate(cols):
            y[0, j] = out[0, slot]
            done[j] = True
    if not all(done):
        raise ComputeError(f"no shard holds expert {row[done.index(False)]} of layer {layer}")
    return y


def _pack(local: np.ndarray, inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the in-range ids left-packed and padded; and each slot's column in that packing."""
    width = int(inside.sum(axis=1).max())
    col = np.cumsum(inside, axis=1) - 1
    first = local[np.arange(local.shape[0]), inside.argmax(axis=1)]
    sel = np.repeat(first[:, None], width, axis=1)
    r, j = np.nonzero(inside)
    sel[r, col[r, j]] = local[r, j]
    return sel.astype(np.int32), np.where(inside, col, 0)


def combine(resid: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """resid + Σ_k weights[:, k] · y[:, k], in slot order like the fused graph."""
    total = y[:, 0] * weights[:, 0, None]
    for j in range(1, y.shape[1]):
        total = total + y[:, j] * weights[:, j, None]
    return resid + total
