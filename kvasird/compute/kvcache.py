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
        for layer in layers:
            type_ = KV_TYPES[spec.dtype]
            self.k[layer] = self.arena.new(f"cache_k.{layer}", type_, (hp.kv_dim, self.n_slots))
            self.v[layer] = self.arena.new(f"cache_v.{layer}", type_, (hp.kv_dim * PAGE, n_pages))
        if layers:
            self.arena.allocate(backend)
        self._free = list(range(n_pages - 1, -1, -1))
        self.max_session_tokens = spec.max_session_tokens or self.n_slots

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

    def open(self) -> Session:
        return Session(self)

    def _take(self) -> int:
        if not self._free:
            raise KVCacheFull(f"the KV pool is full ({self.n_slots} slots): close idle sessions "
                              "or raise the pool size")
        return self._free.pop()

    def _give(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def close(self) -> None:
        self.arena.close()


class Session:
    """One generation's KV state in a pool: how many positions are cached, and where."""

    def __init__(self, pool: KVPool) -> None:
        self.pool: KVPool | None = pool
        self.pages: list[int] = []
        self.n_past = 0

    def reserve(self, start: int, n_tokens: int) -> None:
        """Make room for positions [start, start + n_tokens), dropping cached positions >= start."""
        pool = self._live()
        if not 0 <= start <= self.n_past:
            raise InputError(f"position {start} is past the cached context ({self.n_past} tokens): "
                             "send the missing tokens first")
        end = start + n_tokens
        if end > pool.max_session_tokens:
            raise KVCacheFull(f"{end} tokens exceed the session limit of {pool.max_session_tokens}")
        need = -(-end // PAGE) - len(self.pages)
        if need > len(pool._free):
            raise KVCacheFull(f"the KV pool has {pool.free_tokens} free slots, this request needs "
                              f"{need * PAGE} more: close idle sessions or raise the pool size")
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
        self.n_past = n

    def close(self) -> None:
        if self.pool is not None:
            self.pool._give(self.pages)
            self.pages = []
            self.pool = None

    def _live(self) -> KVPool:
        if self.pool is None:
            raise InputError("the session is closed")
        return self.pool

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
