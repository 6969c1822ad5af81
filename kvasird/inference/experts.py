"""Remote expert dispatch, on the stage side: replicas by latency, failover, spot checks.

A window stage's MoE layer whose experts it does not hold ends its graph at the router
(router authority: the ids and weights are decided here) and calls an ExpertShard per
missing range. Our shard's call runs in the ggml thread; it asks the event loop for
the current holders, covers the range with the cheapest fit workers, and sends each
only its rows and *its* local ids:

    stage thread ─ dispatch(rows, global ids) ─▶ piece [lo, hi) on worker W (holds [e0, e1))
                                                   ids - e0 ─▶ "/kvasir/experts/1" ─▶ W
                                      combine ◀── outputs [m, n, n_embd] ◀──────────┘

A worker that fails or times out is marked unfit and the call is re-planned on
another replica. With probability `spot_check` a call is recomputed on a second
replica; when the two disagree beyond tolerance a third opinion decides, and the
worker that disagrees with it is marked unfit (both are, when there is no third).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from kvasird.compute.errors import ComputeError
from kvasird.compute.experts import ExpertShard, dispatch
from kvasird.inference import tensors
from kvasird.inference.channel import Channels
from kvasird.inference.errors import HopFailed
from kvasird.inference.routing import Fitness, Latency, PeerHoldings, cover_experts, expert_holders
from kvasird.inference.serving import EXPERT_PROTOCOL
from kvasird.logs import get_logger

MAX_ATTEMPTS = 4
log = get_logger("kvasird.inference.experts")


class ExpertDispatcher:
    """Computes expert ranges this node lacks on the workers that hold them."""

    def __init__(self, me: str, holders: Callable[[], list[PeerHoldings]], channels: Channels,
                 latency: Latency, fitness: Fitness, *, timeout_s: float, wire_dtype: str,
                 spot_check: float, tolerance: float) -> None:
        self.me, self.holders, self.channels = me, holders, channels
        self.latency, self.fitness = latency, fitness
        self.timeout_s, self.wire_dtype = timeout_s, wire_dtype
        self.spot_check, self.tolerance = spot_check, tolerance
        self.selected: Counter[tuple[int, int]] = Counter()
        """(layer, expert) -> times selected since the last load report."""
        self.stats = Counter[str]()
        """calls, rows, failovers, spot_checks, caught."""
        self._rng = random.Random()

    def shard(self, layer: int, first: int, end: int) -> ExpertShard:
        return ExpertShard(first, end, lambda lay, rows, sel: self._compute(lay, first, end,
                                                                             rows, sel))

    def _compute(self, layer: int, first: int, end: int, rows: np.ndarray,
                 sel: np.ndarray) -> np.ndarray:
        """In the ggml thread: outputs for shard-local ids `sel`, with failover."""
        gids = sel.astype(np.int64) + first
        for g in np.unique(gids):
            self.selected[(layer, int(g))] += int((gids == g).any(axis=1).sum())
        for attempt in range(MAX_ATTEMPTS):
            pieces = trio.from_thread.run_sync(self._plan, layer, first, end)
            if pieces is None:
                raise ComputeError(f"no fit worker holds experts [{first}, {end}) of layer {layer}")
            shards = [ExpertShard(lo, hi, self._piece_call(peer, e0, lo))
                      for peer, lo, hi, e0, _ in pieces]
            try:
                return dispatch(layer, rows, gids, shards)
            except HopFailed as exc:
                self.fitness.mark(exc.peer, exc.reason)
                self.stats["failovers"] += 1
                log.info("expert worker replaced", peer=exc.peer, layer=layer,
                         reason=exc.reason[:200], attempt=attempt + 1)
        raise ComputeError(f"experts [{first}, {end}) of layer {layer} failed on "
                           f"{MAX_ATTEMPTS} workers")

    def _plan(self, layer: int, first: int, end: int) -> list[tuple[str, int, int, int, int]] | None:
        fit = [h for h in self.holders() if h.peer != self.me and self.fitness.fit(h.peer)]
        return cover_experts(expert_holders(fit, layer, first, end), first, end, self.latency)

    def _piece_call(self, peer: str, e0: int, lo: int) -> Callable[[int, np.ndarray, np.ndarray],
                                                                    np.ndarray]:
        def call(layer: int, rows: np.ndarray, local: np.ndarray) -> np.ndarray:
            gids = local.astype(np.int64) + lo
            return trio.from_thread.run(self.checked, peer, e0, layer, rows, gids)
        return call

    async def checked(self, peer: str, e0: int, layer: int, rows: np.ndarray,
                      gids: np.ndarray) -> np.ndarray:
        out = await self.remote(peer, e0, layer, rows, gids)
        if self.spot_check <= 0 or self._rng.random() >= self.spot_check:
            return out
        self.stats["spot_checks"] += 1
        others = self._replicas(layer, gids, exclude={peer})
        if not others:
            return out
        second, s_e0 = others[0]
        ref = await self.remote(second, s_e0, layer, rows, gids)
        if self._close(out, ref):
            return out
        third = self._replicas(layer, gids, exclude={peer, second})
        if third:
            judge = await self.remote(third[0][0], third[0][1], layer, rows, gids)
            liar, good = (peer, ref) if self._close(ref, judge) else (second, out)
            if not (self._close(ref, judge) or self._close(out, judge)):
                liar, good = peer, judge
            self._caught(liar, layer)
            return good
        self._caught(peer, layer)
        self._caught(second, layer)
        raise HopFailed(peer, "spot check disagreement with no third replica")

    def _caught(self, peer: str, layer: int) -> None:
        self.stats["caught"] += 1
        self.fitness.mark(peer, f"spot check failed on layer {layer}")
        log.warning("worker failed a spot check: marked unfit", peer=peer, layer=layer)

    def _close(self, a: np.ndarray, b: np.ndarray) -> bool:
        scale = max(float(np.abs(b).max()), 1e-6)
        return float(np.abs(a - b).max()) / scale <= self.tolerance

    def _replicas(self, layer: int, gids: np.ndarray, exclude: set[str]) -> list[tuple[str, int]]:
        lo, hi = int(gids.min()), int(gids.max()) + 1
        fit = [h for h in self.holders() if h.peer not in exclude and h.peer != self.me
               and self.fitness.fit(h.peer)]
        found = [(p, e0) for p, e0, e1 in expert_holders(fit, layer, lo, hi) if e0 <= lo and hi <= e1]
        return sorted(found, key=lambda r: self.latency(r[0]))

    async def remote(self, peer: str, e0: int, layer: int, rows: np.ndarray,
                     gids: np.ndarray) -> np.ndarray:
        """One worker call: rows and the worker's local ids (global - e0) out, outputs back."""
        msg: dict[str, Any] = {"op": "experts", "layer": layer,
                               "rows": tensors.encode(rows, self.wire_dtype),
                               "ids": tensors.encode(gids - e0, "i32")}
        began = time.perf_counter()
        reply = await self.channels.request(peer, EXPERT_PROTOCOL, msg, self.timeout_s)
        self.latency.observe(peer, (time.perf_counter() - began) * 1000)
        self.stats["calls"] += 1
        self.stats["rows"] += len(rows)
        try:
            return tensors.decode(reply.get("out"), "experts.out", ("f32", "f16"),
                                  (len(rows), gids.shape[1], rows.shape[1]))
        except Exception as exc:  # noqa: BLE001 - a malformed answer is a failed worker
            raise HopFailed(peer, f"bad expert output: {exc}") from None
