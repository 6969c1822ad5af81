"""A stage: the layer window [a, b) a node serves, optionally with the embedding and the head.

    tokens ─▶ [embed] ─▶ layer a … layer b-1 ─▶ [final norm + output] ─▶ logits
    hidden ─┘                                                          └▶ hidden

A forward is a chain of segments. A segment is one cached ggml graph over whole layers;
it ends early at a MoE layer whose experts are not all held here (or are explicitly
dispatched): the graph stops at the router, Python sends the routed rows to the expert
shards, adds the combined result to the residual, and the next segment continues from
the following layer. With every expert local the window is a single graph.

A layer whose experts are all held here may also be offered elsewhere (`offer`: a fallback
replica beside the expert workers). Its graph then ends at the router only in a forward
told to send it out (`remote`, what `choose_experts` asked the caller's policy for:
measured round trips against `probe`d compute); the graphs of each choice are cached
apart.

Every input is validated before any graph runs (token ids, shapes, positions, KV room);
a session's KV lives in the stage's pool and advances only when a forward succeeds.

`forward_batch` computes several sessions' runs (decode steps, short prompts) as one graph
per segment: their rows go through the projections, FFNs and experts together (the
weights are read once for all of them) and each session's rows attend over its own pages
(kv.pool's pages gathered per session, one mask per session; the attention products are
batched over the sessions of each run length).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvasird.compute import arch as archs
from kvasird.compute.blocks import Blocks, mask_name
from kvasird.compute.errors import InputError, KVCacheFull, RunRefused, WeightsError
from kvasird.compute.experts import ExpertShard, ExpertWorker, check_shards, combine, dispatch
from kvasird.compute.graph import F32, I32, Backend, Builder, GraphCache, ggml, ne_of
from kvasird.compute.hparams import HParams
from kvasird.compute.kv.keys import PAGE
from kvasird.compute.kv.pool import KVPool, KVSpec, Session
from kvasird.compute.runtime import compute_threads
from kvasird.compute.sampling import Sampler
from kvasird.compute.steps import Steps, drive
from kvasird.compute.weights import Source, Weights, load_weights, open_sources, slice_expert_ranges

KV_BUCKET = PAGE
"""Attention gathers the session's KV rounded up to this many slots (masked), so a
decode graph is rebuilt only every KV_BUCKET tokens. A page: the slots past a session's
positions cost attention work (masked to zero weight, so the logits are bitwise the same
for any bucket), and a graph builds in milliseconds. At real widths a long prefill runs
faster with 64-slot buckets than with 256-slot ones (see bench/bench_scale.py --only
prefill)."""
assert KV_BUCKET % PAGE == 0, "attention gathers whole KV pages"

MAX_CHUNK = 512
"""Positions a sliding-window ring keeps beyond its window. A graph computes at most
PREFILL_PIECE of them, but a closing session's ring then still holds the window of every
page boundary in its last 512 positions, where an agent's next call runs on from (prefix
reuse, kv.prefix)."""

STEP_ASIDE_S = 0.05
"""Longest a run waits between its pieces for a waiting forward to take the stage."""

PREFILL_PIECE = PAGE
"""Rows of a longer run one graph computes: a run goes in pieces that end on multiples of
PREFILL_PIECE positions, and between pieces a forward waiting for the stage (a decode step)
goes first, so a long prompt holds a stage for a piece at a time, not for a whole prefill
message. A run's pieces are the same however it was cut into calls (a prefix reused from a
page boundary, a replay after a failover), so each piece's rows are those of the cold run,
whatever kernel a row count selects. At real widths a prefill in 64-row pieces runs as
fast as in 256-row graphs (see bench/bench_scale.py --only prefill), with the same logits
bit for bit."""


@dataclass(frozen=True)
class Segment:
    """Layers [first, end) computed in one graph, plus what comes before and after them."""

    first: int
    """First layer computed whole."""
    end: int
    """One past the last layer computed whole."""
    embed: bool
    """Starts from token ids (the embedding lookup is in this graph)."""
    router: int | None
    """Layer whose attention and router end the graph (its experts are dispatched)."""
    head: bool
    """Ends with the final norm and output matrix."""


class Stage:
    """Weights, KV pool and cached graphs for one window; `forward` runs tokens through it."""

    def __init__(
        self,
        weights: Weights,
        backend: Backend,
        window: tuple[int, int],
        *,
        embed: bool,
        head: bool,
        kv: KVSpec = KVSpec(),
        experts: Mapping[int, Sequence[ExpertShard]] | None = None,
        graph_capacity: int = 16,
    ) -> None:
        hp = weights.hparams
        a, b = _check_window(window, hp)
        self.weights, self.hp, self.backend = weights, hp, backend
        self.arch = archs.for_hparams(hp)
        self.window, self.embed, self.head = (a, b), embed, head
        self.n_vocab = ne_of(weights.get("token_embd.weight"))[1] if embed else hp.n_vocab
        self.shards = {
            int(k): check_shards(int(k), v, hp.n_expert) for k, v in (experts or {}).items()
        }
        self.optional: dict[int, tuple[ExpertShard, ...]] = {}
        """Layers whose experts are loaded here and may also go to other peers (`offer`)."""
        self.choose: Callable[[Stage, tuple[int, ...], int], frozenset[int]] | None = None
        """(this stage, its offered layers, the step's rows) -> those to dispatch this step."""
        self._plans: dict[frozenset[int], tuple[Segment, ...]] = {}
        self._worker: ExpertWorker | None = None
        self.segments = self._plan()
        self.kv = KVPool(backend, hp, range(a, b), kv, chunk=MAX_CHUNK)
        self.graphs = GraphCache(backend, graph_capacity)
        self._lock = threading.RLock()
        self.own_lock = self._lock
        """Held through a forward (its sessions' positions, its graphs), but not the backend:
        what a forward run as steps on an event loop holds across its awaits. Reentrant:
        several sessions' forwards may interleave on one loop thread at their awaits (each
        keeps the graph it is between fetching and running from eviction, GraphCache.using),
        while a forward in another thread waits for all of them."""
        self.queued = 0
        """Forwards waiting for `own_lock` (a prefill in a worker thread behind decode steps
        interleaved on the loop): while any waits, no new step starts on the loop, so the
        lock comes free between them."""
        self.polling = 0
        """Steps on an event loop waiting for `own_lock` (they poll for it, `waiting_on_loop`):
        a long run steps aside between its pieces for them as for `queued` threads."""
        self._queue_lock = threading.Lock()
        self.locks = (self._lock, backend.lock)
        """What a forward holds while it computes (for `held_now`)."""
        self._owns_backend = False

    @classmethod
    def load(
        cls,
        sources: Source | Sequence[Source],
        window: tuple[int, int] | None = None,
        *,
        embed: bool | None = None,
        head: bool | None = None,
        experts: Mapping[int, Sequence[ExpertShard]] | None = None,
        expert_ranges: Mapping[int, tuple[int, int]] | None = None,
        kv: KVSpec = KVSpec(),
        threads: int = 0,
        backend: Backend | None = None,
    ) -> Stage:
        """Load what a window needs from a GGUF, or from several (a node's slices).

        embed/head default to "the window touches that end of the model". A MoE layer
        loads its experts unless `experts` dispatches it; `expert_ranges` loads only
        [e0, e1) of a layer's experts (then that layer must be dispatched, e.g. through
        `local_worker()`'s shard plus remote ones). `threads` is `[compute] threads`
        (0 = one per physical core); pass `backend` instead to share one between stages.
        """
        files = open_sources(sources)
        hp = HParams.from_gguf(files[0])
        a, b = _check_window(window or (0, hp.n_layer), hp)
        embed = a == 0 if embed is None else embed
        head = b == hp.n_layer if head is None else head
        ranged = {**slice_expert_ranges(files), **(expert_ranges or {})}
        tied = not any("output.weight" in f.tensors for f in files)
        names = tensor_names(
            archs.for_hparams(hp),
            hp,
            (a, b),
            embed=embed,
            head=head,
            tied=tied,
            skip_experts=set(experts or ()) - set(ranged),
        )
        own = backend is None
        backend = backend or Backend(compute_threads(threads))
        try:
            weights = load_weights(files, backend, names, expert_ranges)
        except BaseException:
            if own:
                backend.close()
            raise
        try:
            stage = cls(weights, backend, (a, b), embed=embed, head=head, kv=kv, experts=experts)
        except BaseException:
            weights.close()
            if own:
                backend.close()
            raise
        stage._owns_backend = own
        return stage

    def part(self, first: int, end: int) -> Stage:
        """Layers [first, end) of this window as a stage of their own: what a route that
        enters or leaves the window at another boundary computes. It shares this stage's
        weights, KV pool, graph cache and locks (never close it; close this stage); the
        embedding only if it starts where the window does, the head only if it ends there."""
        a, b = self.window
        if not a <= first < end <= b:
            raise InputError(f"layers [{first}, {end}) are not inside this stage's [{a}, {b})")
        if (first, end) == (a, b):
            return self
        part = copy.copy(self)
        part.window = (first, end)
        part.embed, part.head = self.embed and first == a, self.head and end == b
        part.segments = part._plan()
        part._plans = {}
        part._owns_backend = False
        return part

    @property
    def nbytes(self) -> int:
        """Backend memory held: weights plus the KV pool (graphs' work buffers excluded)."""
        return self.weights.nbytes + self.kv.arena.nbytes

    def local_worker(self) -> ExpertWorker:
        """The expert worker over the experts this stage loaded (sharing its backend), made
        once: what a node's own expert calls and `probe` compute on."""
        if self._worker is None:
            self._worker = ExpertWorker(self.weights, self.backend)
        return self._worker

    def set_experts(self, layer: int, shards: Sequence[ExpertShard]) -> None:
        """Route `layer`'s experts through `shards` from now on (the remote wiring hook)."""
        with self._lock:
            self.shards[layer] = check_shards(layer, shards, self.hp.n_expert)
            self._plans.clear()
            self.segments = self._plan()
            self.graphs.close()

    def offer(self, layer: int, shards: Sequence[ExpertShard]) -> None:
        """Let `layer`, whose experts are all loaded here, go to `shards` in the steps where
        `choose` picks them."""
        held = self.weights.experts.get(layer)
        if held is None or held.count != self.hp.n_expert or layer in self.shards:
            raise WeightsError(f"layer {layer}'s experts are not all loaded here: dispatch it")
        with self._lock:
            self.optional[layer] = check_shards(layer, shards, self.hp.n_expert)

    def choose_experts(self, rows: int) -> frozenset[int]:
        """The offered layers of this window that a step of `rows` rows sends out, as
        `choose` says (pass them to its forward). Called where steps begin, on the event
        loop."""
        if not self.optional or self.choose is None:
            return frozenset()
        a, b = self.window
        offered = tuple(lay for lay in sorted(self.optional) if a <= lay < b)
        return self.choose(self, offered, rows) if offered else frozenset()

    def probe(self, layer: int, rows: int) -> float:
        """Seconds this node's copy of `layer`'s experts takes for `rows` rows (each
        selecting n_expert_used experts, the ids spread over the layer's): what computing
        them here instead of on another peer costs."""
        worker = self.local_worker()
        k, n = self.hp.n_expert_used, self.hp.n_expert
        # k distinct ids a row, as a router picks them; the rows' spread over the layer
        ids = (np.arange(rows)[:, None] * 7919 + np.arange(k)[None, :]) % n
        x = np.zeros((rows, self.hp.n_embd), np.float32)
        began = time.perf_counter()
        worker(layer, x, ids)
        return time.perf_counter() - began

    def open_session(self) -> Session:
        return self.kv.open()

    @property
    def dispatches(self) -> bool:
        """Whether every forward sends rows to expert shards (which may be remote calls): a
        layer whose experts are not all here; offered layers only where a forward is told
        to."""
        return any(seg.router is not None for seg in self.segments)

    def shards_of(self, layer: int) -> tuple[ExpertShard, ...]:
        """The shards a dispatched layer's rows go to."""
        return self.shards[layer] if layer in self.shards else self.optional[layer]

    def forward(
        self,
        session: Session,
        inputs: np.ndarray,
        start: int | None = None,
        logits: str = "last",
        remote: frozenset[int] = frozenset(),
    ) -> np.ndarray:
        """Run tokens (or hidden rows) at positions start.. through the window.

        Returns logits [n, n_vocab] when the stage holds the head (n = 1 for "last",
        all tokens for "all"; "embd": no logits, every token's hidden state after the final
        norm [T, n_embd], what llama.cpp pools into embeddings), else hidden states
        [T, n_embd] float32.
        """
        return self._locked(self.forward_steps(session, inputs, start, logits, remote))

    def _locked(self, steps: Steps[Any]) -> Any:
        """Run `steps` here and now, holding `own_lock` (counted in `queued` while waiting
        for it); between the pieces of a long run, forwards waiting for it go first."""
        fresh = not self._lock._is_owned()  # type: ignore[attr-defined]  # (an RLock's)
        self._acquire()

        def serve(need: tuple[Any, ...]) -> Any:
            if need[0] == "pause" and fresh:
                self._step_aside()
            return self.serve(need)

        try:
            return drive(steps, serve)
        finally:
            self._lock.release()

    def _acquire(self) -> None:
        with self._queue_lock:
            self.queued += 1
        try:
            self._lock.acquire()
        finally:
            with self._queue_lock:
                self.queued -= 1

    def _step_aside(self) -> None:
        """Let the forwards waiting for `own_lock` run, then take it back: one of them has
        it once fewer wait (bounded: a waiter that gave up must not stall us)."""
        waiting = self.queued + self.polling
        if not waiting:
            return
        self._lock.release()
        deadline = time.monotonic() + STEP_ASIDE_S
        while self.queued + self.polling >= waiting and time.monotonic() < deadline:
            time.sleep(STEP_ASIDE_S / 100)
        self._acquire()

    @contextlib.contextmanager
    def waiting_on_loop(self) -> Iterator[None]:
        """Counted in `polling` while a step on an event loop waits for `own_lock`."""
        with self._queue_lock:
            self.polling += 1
        try:
            yield
        finally:
            with self._queue_lock:
                self.polling -= 1

    def serve(self, need: tuple[Any, ...]) -> Any:
        """What forward_steps asks for, done here and now: a graph run or expert outputs
        (and nothing between the pieces of a run)."""
        if need[0] == "pause":
            return None
        if need[0] == "run":
            return need[1].run(need[2])
        _, layer, cur, ids = need
        return dispatch(layer, cur, ids, self.shards_of(layer))

    def forward_steps(
        self,
        session: Session,
        inputs: np.ndarray,
        start: int | None = None,
        logits: str = "last",
        remote: frozenset[int] = frozenset(),
    ) -> Steps[np.ndarray]:
        """forward as steps (compute.steps): yields ("run", graph, feed) -> outputs,
        ("experts", layer, rows, global ids) -> expert outputs [T, k, n_embd], and ("pause",)
        -> None between the pieces of a run longer than a piece (PREFILL_PIECE), where a
        caller may let other forwards in. The caller holds `own_lock` while it runs them
        (`forward` does). `remote`: the offered layers this forward sends out."""
        if logits not in ("last", "all", "embd"):
            raise InputError(f"logits must be 'last', 'all' or 'embd', got {logits!r}")
        x = self._check_inputs(inputs)
        if session.pool is not self.kv:
            raise InputError(
                "this session belongs to another stage (or is closed): open one "
                "with this stage's open_session()"
            )
        start = session.n_past if start is None else int(start)
        session.reserve(start, len(x))
        outs, c = [], 0
        while c < len(x):
            end = min(len(x), (start + c) // PREFILL_PIECE * PREFILL_PIECE + PREFILL_PIECE - start)
            last = end == len(x)
            mode = logits if last or logits != "last" or not self.head else "skip"
            out = yield from self._chunk([(session, start + c, end - c)], x[c:end], mode, remote)
            session.advance(start + end)
            if mode != "skip":
                outs.append(out)
            if not last:
                yield ("pause",)
            c = end
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def forward_batch(self, runs: Sequence[tuple[Session, np.ndarray, int]]) -> list[np.ndarray]:
        """Several sessions' runs as one graph per segment: (session, inputs, start) -> per
        run, what `forward` returns for it (the projections and FFNs read the weights once
        for all of them; each session attends over its own KV). A run is a decode step (one
        row) or a short prompt (up to PREFILL_PIECE rows): runs of any lengths mix. Offered
        layers compute here."""
        return self._locked(self.forward_batch_steps(runs))

    def forward_batch_steps(
        self, runs: Sequence[tuple[Session, np.ndarray, int]]
    ) -> Steps[list[np.ndarray]]:
        """forward_batch as steps (see forward_steps). A run that fails its checks raises
        RunRefused (with its index) before anything computes.

        The rows are bitwise what one session's forward gives only where the kernels
        compute a row the same way in any batch (attention does: each session attends
        over its own pages; a quantized matrix product may not): the outputs agree to
        float rounding, which is what a verifier's tolerance allows."""
        if not runs:
            raise InputError("a batch needs at least one session's run")
        if len({id(s) for s, _, _ in runs}) != len(runs):
            raise InputError("a batch runs each session once")
        if len(runs) > 1 and not self.batches:
            raise InputError(
                "this stage's recurrent states take one session per graph: "
                "step its sessions one by one"
            )
        checked = []
        for i, (session, x, start) in enumerate(runs):
            try:  # every check before anything computes: a bad run is its own alone
                x = self._check_inputs(x)
                if len(x) > PREFILL_PIECE:
                    raise InputError(
                        f"a batch takes runs of at most {PREFILL_PIECE} tokens "
                        f"(or hidden rows), got {len(x)}: send a longer one alone"
                    )
                if session.pool is not self.kv:
                    raise InputError(
                        "this session belongs to another stage (or is closed): "
                        "open one with this stage's open_session()"
                    )
                start = session.n_past if start is None else int(start)
                session.reserve(start, len(x))
            except (InputError, KVCacheFull) as exc:
                raise RunRefused(i, exc) from None
            checked.append((session, x, start))
        # runs of one length attend together: the graph takes them grouped, shortest first
        order = sorted(range(len(checked)), key=lambda i: len(checked[i][1]))
        grouped = [(checked[i][0], checked[i][2], len(checked[i][1])) for i in order]
        out = yield from self._chunk(
            grouped,
            np.concatenate([checked[i][1] for i in order]),
            "lasts" if self.head else "all",
        )
        for session, start, rows in grouped:
            session.advance(start + rows)
        outs: list[np.ndarray] = [np.empty(0)] * len(checked)
        at = 0
        for i, (_, _, rows) in zip(order, grouped, strict=True):
            if self.head:  # its last row's logits, as forward gives them
                outs[i] = out[at : at + 1]
                at += 1
            else:
                outs[i] = out[at : at + rows]
                at += rows
        return outs

    @property
    def batches(self) -> bool:
        """Whether one graph may compute several sessions' rows: not with recurrent
        states, which a graph holds for one session (each session's KV pages, and its
        sliding-window ring, are the graph's inputs)."""
        return not self.kv.recurrent

    def _chunk(
        self,
        runs: Sequence[tuple[Session, int, int]],
        x: np.ndarray,
        mode: str,
        remote: frozenset[int] = frozenset(),
    ) -> Steps[np.ndarray]:
        """Rows x of runs (session, start, rows), one after the other, as one graph per
        segment (several sessions only where `batches`; runs of one length consecutive:
        each such group attends as one batched product). `mode` at the head: "last" (the
        last row's logits), "all", "lasts" (each run's last row's), "embd" (every row's
        final norm, no logits) or "skip" (none). `remote`: the offered layers dispatched."""
        T = len(x)
        groups = _groups([rows for _, _, rows in runs])
        n_kv_b = max(-(-(start + rows) // KV_BUCKET) for _, start, rows in runs) * KV_BUCKET
        held = np.arange(n_kv_b)
        qs = [np.arange(start, start + rows)[:, None] for _, start, rows in runs]
        slots = np.concatenate([s.slots(start, start + rows) for s, start, rows in runs])
        shared = {
            "pos": np.concatenate(qs).reshape(T).astype(np.int32),
            "slots": slots,
            "v_slots": self.kv.v_index(slots),
            "kv_pages": np.concatenate([s.page_list(n_kv_b // PAGE) for s, _, _ in runs]),
        }
        masks = [_causal_mask(held, np.stack(q)) for q in _split(qs, groups)]
        if self.kv.window_layers:  # each session's ring, the same number of pages for all
            n_pages = self.kv.window_span(max(r for r, _ in groups), n_kv_b) // PAGE
            chunks = [s.window_chunk(start, start + rows, n_pages) for s, start, rows in runs]
            w_slots = np.concatenate([c[0] for c in chunks])
            shared |= {
                "swa_slots": w_slots,
                "swa_v_slots": self.kv.v_index(w_slots),
                "swa_pages": np.concatenate([c[1] for c in chunks]),
            }
            swa = [
                np.stack(
                    [_causal_mask(c[2], q, self.hp.n_swa) for c, q in zip(cs, q_g, strict=True)]
                )
                for cs, q_g in zip(_split(chunks, groups), _split(qs, groups), strict=True)
            ]
        elif self.hp.n_swa:
            swa = [_causal_mask(held, np.stack(q), self.hp.n_swa) for q in _split(qs, groups)]
        else:
            swa = []
        for g, mask in enumerate(masks):
            shared[mask_name("mask", g)] = mask
        for g, mask in enumerate(swa):
            shared[mask_name("mask_swa", g)] = mask
        if mode == "lasts":
            shared["last_rows"] = (np.cumsum([rows for _, _, rows in runs]) - 1).astype(np.int32)
        if self.hp.rope_sections:
            shared["pos_sections"] = np.concatenate(
                [np.tile(shared["pos"], 3), np.zeros(T, np.int32)]
            )
        session = runs[0][0]
        if session.state is not None:
            shared["state_slot"] = np.array([session.state], np.int32)
            shared["state_row"] = np.array([session.state], np.int64)
        for i, seg in enumerate(self._segments(remote)):
            # parts of a window share its cache
            key = (self.window, remote, i, n_kv_b, mode, groups)
            build = functools.partial(self._build, seg, n_kv_b, mode, groups)
            with self.graphs.using(key, build) as graph:
                feed = {name: shared[name] for name in graph.inputs if name in shared}
                feed["x"] = x
                out = yield "run", graph, feed
            if seg.router is None:
                x = out["out"]
                x = x.reshape(-1, x.shape[-1])
                continue
            layer, E, k = seg.router, self.hp.n_embd, self.hp.n_expert_used
            cur, ids = out["cur"].reshape(T, E), out["ids"].reshape(T, k)
            y = yield "experts", layer, cur, ids
            resid, w = out["resid"].reshape(T, E), out["weights"].reshape(T, k)
            # a shared expert joins the routed sum before the residual, as in the graph
            x = (
                combine(resid, y, w)
                if "shared" not in out
                else resid + combine(out["shared"].reshape(T, E), y, w)
            )
        return x

    def _build(self, seg: Segment, n_kv: int, mode: str, groups: tuple[tuple[int, int], ...]):
        hp, arch = self.hp, self.arch
        T = sum(rows * n for rows, n in groups)

        def build(b: Builder) -> dict:
            blocks = Blocks(b, self.weights, self.kv, T, n_kv, groups)
            if (
                seg.head
                and seg.router is None
                and seg.end > seg.first
                and mode not in ("all", "embd")
            ):
                # the last layer's FFN and the head only for the rows read on ("skip": the
                # last row's output, unread: every row's KV is written all the same)
                blocks.keep = (seg.end - 1, "lasts" if mode == "lasts" else "last")
            if seg.embed:
                x = blocks.embed(
                    b.input("x", I32, T), math.sqrt(hp.n_embd) if arch.scaled_embedding else None
                )
            else:
                x = b.input("x", F32, hp.n_embd, T)
            for layer in range(seg.first, seg.end):
                x = arch.layer(blocks, layer, x)
            if seg.router is not None:
                assert arch.dense is not None
                r = arch.dense(blocks, seg.router, x)
                outs = {
                    "resid": r.resid,
                    "cur": r.cur,
                    "ids": ggml.ggml_cont(b.ctx, r.ids),
                    "weights": ggml.ggml_cont(b.ctx, r.weights),
                }
                return outs if r.shared is None else {**outs, "shared": r.shared}
            if seg.head and mode == "embd":
                x = blocks.norm(x, "output_norm.weight")
            elif seg.head and mode != "skip":
                x = blocks.head(
                    x
                    if blocks.kept or mode == "all"
                    else blocks.last_column(x)
                    if mode == "last"
                    else blocks.last_rows(x)
                )
            return {"out": x}

        return build

    def _segments(self, remote: frozenset[int]) -> tuple[Segment, ...]:
        if not remote:
            return self.segments
        plan = self._plans.get(remote)
        if plan is None:
            plan = self._plans[remote] = self._plan(remote)
        return plan

    def _plan(self, remote: frozenset[int] = frozenset()) -> tuple[Segment, ...]:
        a, b = self.window
        segs, first, embed = [], a, self.embed
        for layer in range(a, b):
            if not self.arch.is_moe or (layer not in remote and not self._dispatched(layer)):
                continue
            segs.append(Segment(first, layer, embed, router=layer, head=False))
            first, embed = layer + 1, False
        segs.append(Segment(first, b, embed, router=None, head=self.head))
        return tuple(segs)

    def _dispatched(self, layer: int) -> bool:
        if layer in self.shards:
            return True
        held = self.weights.experts.get(layer)
        if held is None or held.count != self.hp.n_expert:
            raise WeightsError(
                f"layer {layer}'s experts are neither all loaded here nor "
                "dispatched: pass expert shards for it"
            )
        return False

    def _check_inputs(self, inputs: np.ndarray) -> np.ndarray:
        x = np.asarray(inputs)
        if self.embed:
            if x.ndim != 1 or x.dtype.kind not in "iu" or len(x) == 0:
                raise InputError(
                    f"this stage starts at the embedding: send a non-empty 1-D array "
                    f"of token ids, got {x.dtype} {list(x.shape)}"
                )
            if x.min() < 0 or x.max() >= self.n_vocab:
                raise InputError(
                    f"token id {int(x.max() if x.max() >= self.n_vocab else x.min())} "
                    f"is outside the vocabulary 0..{self.n_vocab - 1}"
                )
            return x.astype(np.int32)
        if x.ndim != 2 or x.shape[1] != self.hp.n_embd or x.dtype.kind != "f" or len(x) == 0:
            raise InputError(
                f"this stage takes hidden states float [n_tokens, {self.hp.n_embd}], "
                f"got {x.dtype} {list(x.shape)}"
            )
        return np.ascontiguousarray(x, np.float32)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self.graphs.close()
        self.kv.close()
        self.weights.close()
        if self._owns_backend:
            self.backend.close()


@contextlib.contextmanager
def held_now(holders: Sequence[Stage | ExpertWorker | Backend]) -> Iterator[bool]:
    """Take the locks a computation on `holders` (stages, expert workers) needs, without
    waiting.

    Yields True when every one was free: the caller holds them and may compute on its
    own thread without blocking it behind another (an event loop computing a short step
    in place, which spares a thread hand-off per hop: see bench/bench_swarm.py's per-hop
    breakdown).
    Yields False, holding nothing, when any is busy.
    """
    with locks_now(lock for h in holders for lock in h.locks) as held:
        yield held


@contextlib.contextmanager
def locks_now(locks: Iterable[Any]) -> Iterator[bool]:
    """Take every one of `locks` without waiting: yields True holding them all, or False
    holding none."""
    locks = list(dict.fromkeys(locks))
    taken = []
    try:
        for lock in locks:
            if not lock.acquire(blocking=False):
                break
            taken.append(lock)
        yield len(taken) == len(locks)
    finally:
        for lock in reversed(taken):
            lock.release()


def _groups(lengths: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(rows, runs) of each group of consecutive runs of one length."""
    return tuple((rows, len(list(same))) for rows, same in itertools.groupby(lengths))


def _split(items: Sequence[Any], groups: Sequence[tuple[int, int]]) -> list[Sequence[Any]]:
    """Per group, its runs' items."""
    out, at = [], 0
    for _, n in groups:
        out.append(items[at : at + n])
        at += n
    return out


def _causal_mask(held: np.ndarray, q: np.ndarray, window: int = 0) -> np.ndarray:
    """Attention mask [..., len(q), len(held)] (q: [..., n, 1], a sequence's queries per
    leading index): 0 where query position q[i] sees the position `held[j]` a gathered slot
    holds (not after it, and within `window` when there is one), -inf elsewhere."""
    seen = held[None, :] <= q
    if window:
        seen &= q - held[None, :] < window
    return np.where(seen, np.float32(0.0), np.float32(-np.inf))  # float32 as made: no cast


def _check_window(window: tuple[int, int], hp: HParams) -> tuple[int, int]:
    a, b = int(window[0]), int(window[1])
    if not 0 <= a <= b <= hp.n_layer:
        raise InputError(f"window [{a}, {b}) is outside the model's layers 0..{hp.n_layer}")
    return a, b


def tensor_names(
    arch: archs.Architecture,
    hp: HParams,
    window: tuple[int, int],
    *,
    embed: bool,
    head: bool,
    tied: bool,
    skip_experts: Iterable[int] = (),
) -> list[str]:
    """Names of every tensor a window needs (the head's output is token_embd when tied)."""
    skip = set(skip_experts)
    names = []
    for layer in range(*window):
        names += [f"blk.{layer}.{s}" for s in arch.layer_tensors(hp, layer)]
        if layer not in skip:
            names += [f"blk.{layer}.{s}" for s in arch.expert_tensors]
    if embed:
        names.append("token_embd.weight")
    if head:
        names.append("output_norm.weight")
        names.append("token_embd.weight" if tied else "output.weight")
    return list(dict.fromkeys(names))


def generate(
    stage: Stage,
    prompt: Sequence[int],
    n_new: int,
    sampler: Sampler | None = None,
    stop: Iterable[int] = (),
) -> list[int]:
    """Prompt in, up to n_new sampled tokens out, on a stage holding the whole model."""
    if not (stage.embed and stage.head):
        raise InputError("generate needs a stage holding the embedding and the head")
    sample = sampler or Sampler()
    stops, history, out = set(stop), list(prompt), []
    with stage.open_session() as session:
        logits = stage.forward(session, np.asarray(prompt, np.int64))
        for _ in range(n_new):
            token = sample(logits[-1], history)
            out.append(token)
            history.append(token)
            if token in stops or len(out) == n_new:
                break
            logits = stage.forward(session, np.array([token]))
    return out
