"""The KV cache: one bounded pool per stage, handed to sessions in pages.

Each held layer has a K and a V tensor of `n_slots` token slots. A session owns a list
of pages of PAGE slots; position p lives in slot pages[p // PAGE] * PAGE + p % PAGE.
K is stored a row per slot (a token's keys for all KV heads, [kv_dim, n_slots]); V is
stored transposed within each page ([PAGE, kv_dim] per page, i.e. [PAGE * kv_dim,
n_pages]), so that attention can gather a session's V^T as whole page rows instead of
transposing element by element (llama.cpp keeps V transposed for the same reason).
Graphs write new keys with `set_rows` by slot, new values by (slot, channel) through
`v_index`, and gather a session's pages with `get_rows`, all through index inputs, so
one cached graph serves every session: nothing session-specific is baked into a graph.
Memory is fixed when the stage starts; a session that cannot get a page gets
KVCacheFull, never an allocation inside ggml.

A gated delta-net layer (the Qwen3.5 hybrids) keeps no KV: its session state is a fixed
size, the convolution's last inputs and the delta rule's matrices, and it lives here too,
one row per state slot of `cache_conv.N` and `cache_delta.N`. A session takes a slot when
it first runs and gives it back when it closes, so the same limits and expiry cover it.
Such a state only moves forward: a session can continue where it is or start again at
position 0 (a replay rebuilds it), never rewind in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvasird.compute.errors import InputError, KVCacheFull
from kvasird.compute.graph import F16, F32, Backend, Tensor, TensorArena, ggml
from kvasird.compute.hparams import HParams

PAGE = 64
"""Slots per page: the unit a session grows by."""

KV_TYPES = {"f32": F32, "f16": F16}


@dataclass(frozen=True)
class KVSpec:
    """Size and precision of a stage's KV pool."""

    n_slots: int = 4096
    """Total token slots shared by all sessions of the stage (rounded up to pages)."""
    dtype: str = "f16"
    """Storage type, "f16" (llama.cpp's default) or "f32" (bit-faithful to the activations)."""
    max_session_tokens: int = 0
    """Per-session limit; 0 = the whole pool."""
    state_slots: int = 8
    """Sessions that can hold a recurrent state at once (models with delta-net layers)."""


class KVPool:
    """K and V tensors for `layers`, and the free list of pages."""

    def __init__(self, backend: Backend, hp: HParams, layers: range, spec: KVSpec) -> None:
        if spec.dtype not in KV_TYPES:
            raise InputError(f"kv dtype {spec.dtype!r} is not one of {', '.join(KV_TYPES)}")
        n_pages = max(1, -(-spec.n_slots // PAGE))
        self.n_slots = n_pages * PAGE
        self.n_pages = n_pages
        self.kv_dim = hp.kv_dim
        self.spec = spec
        self.arena = TensorArena(2 * len(layers))
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.conv: dict[int, Tensor] = {}
        """Delta-net layers' convolution states, [conv_state, state_slots] float32."""
        self.delta: dict[int, Tensor] = {}
        """Delta-net layers' recurrent matrices, [delta_state, state_slots] float32."""
        for layer in layers:
            if hp.is_recurrent(layer):
                self.conv[layer] = self.arena.new(f"cache_conv.{layer}", F32,
                                                  (hp.conv_state, spec.state_slots))
                self.delta[layer] = self.arena.new(f"cache_delta.{layer}", F32,
                                                   (hp.delta_state, spec.state_slots))
                continue
            type_ = KV_TYPES[spec.dtype]
            self.k[layer] = self.arena.new(f"cache_k.{layer}", type_, (hp.kv_dim, self.n_slots))
            self.v[layer] = self.arena.new(f"cache_v.{layer}", type_, (hp.kv_dim * PAGE, n_pages))
        if layers:
            self.arena.allocate(backend)
        self._free = list(range(n_pages - 1, -1, -1))
        self._free_states = list(range(spec.state_slots - 1, -1, -1)) if self.conv else []
        self.max_session_tokens = spec.max_session_tokens or self.n_slots

    @property
    def recurrent(self) -> bool:
        """Whether the pool holds delta-net layers (sessions then keep a state slot)."""
        return bool(self.conv)

    def v_flat(self, ctx: object, layer: int) -> Tensor:
        """Layer's V cache as [1, n_slots * kv_dim]: one value per row, for `set_rows`."""
        return ggml.ggml_reshape_2d(ctx, self.v[layer], 1, self.n_slots * self.kv_dim)

    def v_index(self, slots: np.ndarray) -> np.ndarray:
        """Where each value of tokens in `slots` goes in `v_flat`, token-major (the order of
        a [kv_dim, T] tensor's elements)."""
        slots = np.asarray(slots, np.int64)
        base = (slots // PAGE) * (PAGE * self.kv_dim) + slots % PAGE
        return (base[:, None] + np.arange(self.kv_dim, dtype=np.int64)[None, :] * PAGE).ravel()

    @property
    def free_tokens(self) -> int:
        return len(self._free) * PAGE

    @property
    def free_states(self) -> int:
        """Recurrent-state slots no session holds (0 where the pool has no delta-net layer)."""
        return len(self._free_states)

    def open(self) -> Session:
        return Session(self)

    def _take(self) -> int:
        if not self._free:
            raise KVCacheFull(f"the KV pool is full ({self.n_slots} slots): close idle sessions "
                              "or raise the pool size")
        return self._free.pop()

    def _give(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def _take_state(self) -> int:
        if not self._free_states:
            raise KVCacheFull(f"all {self.spec.state_slots} recurrent-state slots are in use: "
                              "close idle sessions or raise the number of state slots")
        return self._free_states.pop()

    def _clear_state(self, slot: int) -> None:
        """Zero a slot's states: a delta-net starts from nothing at position 0."""
        for t in (*self.conv.values(), *self.delta.values()):
            row = int(t.contents.nb[1])
            ggml.ggml_backend_tensor_memset(t, 0, slot * row, row)

    def close(self) -> None:
        self.arena.close()


class Session:
    """One generation's KV state in a pool: how many positions are cached, and where."""

    def __init__(self, pool: KVPool) -> None:
        self.pool: KVPool | None = pool
        self.pages: list[int] = []
        self.n_past = 0
        self.state: int | None = None
        """The pool's recurrent-state slot this session holds (None: none yet, or no
        delta-net layer here)."""

    def reserve(self, start: int, n_tokens: int) -> None:
        """Make room for positions [start, start + n_tokens), dropping cached positions >= start."""
        pool = self._live()
        if not 0 <= start <= self.n_past:
            raise InputError(f"position {start} is past the cached context ({self.n_past} tokens): "
                             "send the missing tokens first")
        if pool.recurrent and 0 < start < self.n_past:
            raise InputError(f"a recurrent state cannot go back to position {start} "
                             f"(it holds {self.n_past}): replay the history from position 0")
        end = start + n_tokens
        if end > pool.max_session_tokens:
            raise KVCacheFull(f"{end} tokens exceed the session limit of {pool.max_session_tokens}")
        need = -(-end // PAGE) - len(self.pages)
        if need > len(pool._free):
            raise KVCacheFull(f"the KV pool has {pool.free_tokens} free slots, this request needs "
                              f"{need * PAGE} more: close idle sessions or raise the pool size")
        if pool.recurrent:
            if self.state is None:
                self.state = pool._take_state()
            if start == 0:
                pool._clear_state(self.state)
        for _ in range(need):
            self.pages.append(pool._take())
        self.n_past = start

    def page_list(self, n_pages: int) -> np.ndarray:
        """The session's first pages in position order, padded to `n_pages` with its first
        page (padding is masked out)."""
        pages = np.full(n_pages, self.pages[0], np.int32)
        held = min(n_pages, len(self.pages))
        pages[:held] = self.pages[:held]
        return pages

    def slots(self, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end, dtype=np.int64)
        return np.asarray(self.pages, dtype=np.int64)[pos // PAGE] * PAGE + pos % PAGE

    def advance(self, end: int) -> None:
        self.n_past = end

    def truncate(self, n: int) -> None:
        """Forget positions >= n (a replay after failover, or a rejected draft)."""
        if not 0 <= n <= self.n_past:
            raise InputError(f"cannot truncate to {n}: the session holds {self.n_past} positions")
        if self.pool is not None and self.pool.recurrent and 0 < n < self.n_past:
            raise InputError(f"a recurrent state cannot be truncated to {n} of {self.n_past} "
                             "positions: replay the history from position 0")
        self.n_past = n

    def close(self) -> None:
        if self.pool is not None:
            self.pool._give(self.pages)
            self.pages = []
            if self.state is not None:
                self.pool._free_states.append(self.state)
                self.state = None
            self.pool = None

    def _live(self) -> KVPool:
        if self.pool is None:
            raise InputError("the session is closed")
        return self.pool

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
