"""The KV pool: one bounded pool per stage, handed to sessions in pages.

Each held attention layer has a K and a V tensor of `n_slots` token slots (a sliding-window
layer fewer, window.py). A session owns a list of pages of PAGE slots; position p lives in
slot pages[p // PAGE] * PAGE + p % PAGE.
K is stored a row per slot (a token's keys for all KV heads, [kv_dim, n_slots]); V is
stored transposed within each page ([PAGE, kv_dim] per page, i.e. [PAGE * kv_dim,
n_pages]), so that attention can gather a session's V^T as whole page rows instead of
transposing element by element (llama.cpp keeps V transposed for the same reason).
Graphs write new keys with `set_rows` by slot, new values by (slot, channel) through
`v_index`, and gather a session's pages with `get_rows`, all through index inputs, so
one cached graph serves every session: nothing session-specific is baked into a graph.
Memory is fixed when the stage starts; a session that cannot get a page gets
KVCacheFull, never an allocation inside ggml.

The pool holds three kinds of room, all fixed at start: the main pool's pages, the window
pool's ring pages (window.py) and the delta-net state slots (recurrent.py). A Session takes
what its positions need of each in one `reserve`, and gives all of it back on `close`,
some of it to the prefix cache (prefix.py); pages the cache keeps are free for the taking,
so `free_tokens` and `free_states` count them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from kvasird.compute.errors import InputError, KVCacheFull
from kvasird.compute.graph import F16, F32, Backend, Tensor, TensorArena, ggml
from kvasird.compute.hparams import HParams
from kvasird.compute.kv.keys import PAGE
from kvasird.compute.kv.prefix import PrefixCache
from kvasird.compute.kv.recurrent import StateSlots
from kvasird.compute.kv.window import first_page, ring_chunk, ring_pages

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
    window_sessions: int = 8
    """Sessions whose sliding-window layers can hold a whole ring at once (models with
    sliding-window layers): the window pool's size in rings, at most the main pool's pages."""
    swa_full: bool = False
    """Keep every position of the sliding-window layers in the main pool, masked to the
    window (llama.cpp's swa_full): a full layer's memory, but a session can go back anywhere."""


class KVPool:
    """K and V tensors for `layers`, their delta-net states (`states`), and the free lists
    of pages."""

    def __init__(
        self, backend: Backend, hp: HParams, layers: range, spec: KVSpec, *, chunk: int
    ) -> None:
        """`chunk` is the most positions one graph computes: a ring holds it and its window."""
        if spec.dtype not in KV_TYPES:
            raise InputError(f"kv dtype {spec.dtype!r} is not one of {', '.join(KV_TYPES)}")
        if spec.window_sessions < 1:
            raise InputError(f"window_sessions must be at least 1, got {spec.window_sessions}")
        n_pages = max(1, -(-spec.n_slots // PAGE))
        self.n_slots = n_pages * PAGE
        self.n_pages = n_pages
        self.kv_dim = hp.kv_dim
        self.spec = spec
        self.n_swa = hp.n_swa
        self.window_layers = frozenset(
            ()
            if spec.swa_full
            else (layer for layer in layers if hp.is_swa(layer) and not hp.is_recurrent(layer))
        )
        """Sliding-window layers whose KV lives in the window pool."""
        self.ring = ring_pages(hp.n_swa, chunk) if self.window_layers else 0
        """Window-pool pages of a whole ring."""
        self.n_window_pages = min(n_pages, spec.window_sessions * self.ring)
        self.arena = TensorArena(2 * len(layers))
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.states = StateSlots(self.arena, hp, layers, spec.state_slots)
        """The delta-net layers' states, a slot per session."""
        for layer in layers:
            if hp.is_recurrent(layer):
                continue
            type_, pages = KV_TYPES[spec.dtype], self.pages(layer)
            self.k[layer] = self.arena.new(f"cache_k.{layer}", type_, (hp.kv_dim, pages * PAGE))
            self.v[layer] = self.arena.new(f"cache_v.{layer}", type_, (hp.kv_dim * PAGE, pages))
        if layers:
            self.arena.allocate(backend)
        self._free = list(range(n_pages - 1, -1, -1))
        self._refs = [0] * n_pages
        """References to each main-pool page: its session's, and the prefix cache's."""
        self.prefix: PrefixCache | None = PrefixCache(self)
        """Closed sessions' pages (and states) by prefix key."""
        self._free_window = list(range(self.n_window_pages - 1, -1, -1))
        self.max_session_tokens = spec.max_session_tokens or self.n_slots

    @property
    def recurrent(self) -> bool:
        """Whether the pool holds delta-net layers (sessions then keep a state slot)."""
        return bool(self.states.conv)

    def pages(self, layer: int) -> int:
        """Pages of `layer`'s K and V: the window pool's or the main pool's."""
        return self.n_window_pages if layer in self.window_layers else self.n_pages

    def window_span(self, n_tokens: int, n_kv: int) -> int:
        """Slots a window layer's attention gathers for n_tokens queries in a graph whose
        full layers gather n_kv: the ring pages holding their window, never more than n_kv."""
        return min(self.ring, ring_pages(self.n_swa, n_tokens), n_kv // PAGE) * PAGE

    def v_flat(self, ctx: object, layer: int) -> Tensor:
        """Layer's V cache as [1, slots * kv_dim]: one value per row, for `set_rows`."""
        return ggml.ggml_reshape_2d(ctx, self.v[layer], 1, self.pages(layer) * PAGE * self.kv_dim)

    def v_index(self, slots: np.ndarray) -> np.ndarray:
        """Where each value of tokens in `slots` (of either pool) goes in `v_flat`,
        token-major (the order of a [kv_dim, T] tensor's elements)."""
        slots = np.asarray(slots, np.int64)
        base = (slots // PAGE) * (PAGE * self.kv_dim) + slots % PAGE
        return (base[:, None] + np.arange(self.kv_dim, dtype=np.int64)[None, :] * PAGE).ravel()

    @property
    def free_tokens(self) -> int:
        """Positions a new session could cache now: the main pool's free pages, or fewer
        where the window pool could not give that session its ring."""
        free = self.free_pages
        if self.window_layers and self.free_window_pages < min(free, self.ring):
            free = self.free_window_pages
        return free * PAGE

    @property
    def free_window_pages(self) -> int:
        """Window-pool pages a session could take now: free ones and kept rings' (taking
        one evicts its ring)."""
        return len(self._free_window) + (self.prefix.ring_pages if self.prefix else 0)

    def window_from(self, start: int) -> int:
        """The first window page a chunk from position `start` reads."""
        return first_page(self.n_swa, start)

    @property
    def free_pages(self) -> int:
        """Main-pool pages a session could take now: free ones, and cached ones no session
        shares (taking one evicts it)."""
        return len(self._free) + (self.prefix.evictable if self.prefix is not None else 0)

    @property
    def free_states(self) -> int:
        """Recurrent-state slots a new session could take now: free ones, kept states' and
        live sessions' marks (0 where the pool has no delta-net layer)."""
        kept = len(self.prefix.states) if self.prefix is not None else 0
        return len(self.states.free) + kept + len(self.states.marked) + len(self.states.rewinds)

    def open(self) -> Session:
        return Session(self)

    def _take(self) -> int:
        if not self._free and self.prefix is not None:
            self.prefix.evict()
        if not self._free:
            raise KVCacheFull(
                f"the KV pool is full ({self.n_slots} slots): close idle sessions "
                "or raise the pool size"
            )
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _take_window(self) -> int:
        if not self._free_window and self.prefix is not None:
            self.prefix.evict_ring()
        return self._free_window.pop()

    def _release(self, page: int) -> None:
        """Drop one reference to `page`; the last one frees it."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def _give(self, pages: list[int], ring: list[int]) -> None:
        for page in reversed(pages):
            self._release(page)
        self._free_window.extend(reversed(ring))

    def _copy_page(self, src: int, dst: int, window: bool = False) -> None:
        """Copy page `src`'s K and V into page `dst`: of every main-pool layer, or with
        `window` of every window-pool layer."""
        # K [kv_dim, slots] holds a page as PAGE rows, V [kv_dim * PAGE, pages] as one row
        layers = [la for la in self.k if (la in self.window_layers) == window]
        runs = [(self.k[la], PAGE) for la in layers] + [(self.v[la], 1) for la in layers]
        for t, rows in runs:
            n = int(t.contents.nb[1]) * rows
            buf = (ctypes.c_uint8 * n)()
            ggml.ggml_backend_tensor_get(t, buf, src * n, n)
            ggml.ggml_backend_tensor_set(t, buf, dst * n, n)

    def _take_state(self) -> int:
        if not self.states.free and self.prefix is not None:
            self.prefix.evict_state()
        if not self.states.free and self.states.marked:  # a live session's mark gives way
            next(iter(self.states.marked.values()))._drop_mark()
        if not self.states.free and self.states.rewinds:  # then one's way back past a guess
            next(iter(self.states.rewinds.values())).drop_rewinds(lost=True)
        if not self.states.free:
            raise KVCacheFull(
                f"all {self.spec.state_slots} recurrent-state slots are in use: "
                "close idle sessions or raise the number of state slots"
            )
        return self.states.free.pop()

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
        self.ring: list[int] = []
        """Window-pool pages: ring[k] holds the window pages P with P % pool.ring == k."""
        self.ring_top = -1
        """The highest window page a graph may have written since position 0 (one that
        failed may have written its chunk): the ring holds pages from ring_top - ring + 1."""
        self.ring_from = 0
        """The first window page the ring holds at all (a session started from a kept ring
        holds only the window before its first position)."""
        self.mark: int | None = None
        """A state slot holding a copy of `state` at position `mark_at` (None: no copy)."""
        self.mark_at = 0
        """The page boundary the mark was copied at."""
        self.rewinds: dict[int, int] = {}
        """Position -> a state slot holding the state there: the copies a speculative step
        computed one position at a time keeps, so that the next step may start after any
        guess it checked (keep_rewind); dropped when the next step starts."""
        self.rewind_lost = False
        """A copy keep_rewind should have kept is missing: no slot was free, or another
        session took it (a step that would go back there finds the hop out of capacity)."""

    def reserve(self, start: int, n_tokens: int) -> None:
        """Make room for positions [start, start + n_tokens), dropping cached positions >= start."""
        pool = self._live()
        if not 0 <= start <= self.n_past:
            raise InputError(
                f"position {start} is past the cached context ({self.n_past} tokens): "
                "send the missing tokens first"
            )
        if pool.recurrent and 0 < start < self.n_past and not self._rewind(start):
            self._cannot_go_back(start)
        self._check_window(start)
        end = start + n_tokens
        if end > pool.max_session_tokens:
            raise KVCacheFull(f"{end} tokens exceed the session limit of {pool.max_session_tokens}")
        need = -(-end // PAGE) - len(self.pages) + self._shared_from(start)
        if need > len(pool._free) and need > pool.free_pages:  # counting kept pages: rarely
            raise KVCacheFull(
                f"the KV pool has {pool.free_pages * PAGE} free slots, this "
                f"request needs {need * PAGE} more: close idle sessions or raise "
                "the pool size"
            )
        need_ring = max(0, min(-(-end // PAGE), pool.ring) - len(self.ring))
        if need_ring > pool.free_window_pages:
            raise KVCacheFull(
                f"the sliding-window pool has {pool.free_window_pages * PAGE} free "
                f"slots, this request needs {need_ring * PAGE} more: close idle "
                "sessions or raise the number of window sessions"
            )
        if start == 0:
            self.ring_top, self.ring_from = -1, 0
            if self.mark is not None:  # a history from scratch: the old one's copy is stale
                self._drop_mark()
        self._unshare(start)
        self.ring += [pool._take_window() for _ in range(need_ring)]
        if pool.recurrent:
            if self.state is None:
                self.state = pool._take_state()
            if start == 0:
                pool.states.clear(self.state)
        for _ in range(need):
            self.pages.append(pool._take())
        self.n_past = start

    def attach(self, scope: Hashable, keys: Sequence[bytes]) -> tuple[int, np.ndarray | None]:
        """Start a new session from the longest run of `keys` the pool's prefix cache holds
        for `scope`: (positions it starts with, their token ids where the cache kept them)."""
        pool = self._live()
        if self.pages or self.n_past or pool.prefix is None:
            return 0, None
        self.pages, ids, kept, state = pool.prefix.lookup(scope, keys)
        n = len(self.pages)
        if state is not None:  # the state at position n * PAGE, into a slot of its own
            try:  # `state` is the freshest: taking a slot evicts the other kept states first
                self.state = pool._take_state()
            except KVCacheFull:
                pool._give(self.pages, [])
                self.pages = []
                return 0, None
            if self.state != state:
                pool.states.copy(state, self.state)
        if kept is not None:  # the window before position n * PAGE, into a ring of its own
            first, size = pool.window_from(n * PAGE), min(n, pool.ring)
            if pool.free_window_pages - len(kept.pages) < size:  # only by evicting `kept`
                pool._give(self.pages, [])
                self.pages = []
                return 0, None
            # `kept` is the freshest: the pages taken evict the other rings first
            self.ring = [pool._take_window() for _ in range(size)]
            for j in range(first, n):
                pool._copy_page(kept.pages[j - kept.low], self.ring[j % pool.ring], window=True)
            self.ring_top, self.ring_from = n - 1, first
        self.n_past = n * PAGE
        return self.n_past, ids

    def _shared_from(self, start: int) -> int:
        """Pages from the one holding `start` on that other holders share."""
        pool = self._live()
        return sum(pool._refs[p] > 1 for p in self.pages[start // PAGE :])

    def _unshare(self, start: int) -> None:
        """Give the session pages of its own from position `start` on: a shared page there
        is swapped for a fresh one (a copy of it where it holds positions before `start`)."""
        pool = self._live()
        for i in range(start // PAGE, len(self.pages)):
            page = self.pages[i]
            if pool._refs[page] > 1:
                fresh = pool._take()
                if i * PAGE < start:
                    pool._copy_page(page, fresh)
                pool._release(page)
                self.pages[i] = fresh

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

    def window_chunk(
        self, start: int, end: int, n_pages: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What the window layers of a graph computing positions [start, end) write and read:
        the window-pool slots those positions go to; the ring pages holding the queries'
        windows in position order, padded to `n_pages` with the first; and the position each
        slot of those pages holds (padding: past every query, so masked). From here on the
        ring counts [start, end) as written, the graph about to run may write them."""
        pool = self._live()
        chunk = ring_chunk(self.ring, pool.ring, pool.n_swa, start, end, n_pages)
        self.ring_top = max(self.ring_top, (end - 1) // PAGE)
        return chunk

    def advance(self, end: int) -> None:
        self.n_past = end
        if self.state is not None and end % PAGE == 0 and self.pool is not None:
            self._mark(end)

    def _mark(self, end: int) -> None:
        """Copy the state, which now holds positions [0, end), into the session's mark: a
        slot no one else needs (a kept state's at most), else none is taken."""
        pool = self._live()
        if self.mark is None:
            if not pool.states.free and pool.prefix is not None:
                pool.prefix.evict_state()
            if not pool.states.free:
                return
            self.mark = pool.states.free.pop()
            pool.states.marked[self.mark] = self
        assert self.state is not None
        pool.states.copy(self.state, self.mark)
        self.mark_at = end

    def keep_rewind(self) -> None:
        """Copy the state, which holds positions [0, n_past), into a slot of its own, so that
        a later step may start here though the session computes past it (a speculative
        step's guess the head may reject). Best effort: a slot free, a kept state's or a
        live session's mark; without one, a step starting here goes back to an earlier copy
        and recomputes from it (StageServer._go_back), or is refused as out of capacity."""
        pool = self._live()
        if self.state is None or self.n_past in self.rewinds:
            return
        if not pool.states.free and pool.prefix is not None:
            pool.prefix.evict_state()
        if not pool.states.free and pool.states.marked:
            next(iter(pool.states.marked.values()))._drop_mark()
        if not pool.states.free:
            self.rewind_lost = True
            return
        slot = pool.states.free.pop()
        pool.states.copy(self.state, slot)
        pool.states.rewinds[slot] = self
        self.rewinds[self.n_past] = slot

    def _rewind(self, start: int) -> bool:
        """Go back to position `start` from a copy keep_rewind kept there, if any."""
        slot = self.rewinds.get(start)
        if slot is None or self.state is None:
            return False
        self._live().states.copy(slot, self.state)
        if self.mark is not None and self.mark_at > start:  # copied past it: stale
            self._drop_mark()
        self.drop_rewinds()  # the others: past `start` (stale) or before it (confirmed)
        self.n_past = start
        return True

    def _cannot_go_back(self, start: int) -> None:
        if self.rewind_lost:
            raise KVCacheFull(
                f"no recurrent-state slot was free to keep the state at position {start}: "
                "retry shortly, or raise [inference] state_slots"
            )
        raise InputError(
            f"a recurrent state cannot go back to position {start} "
            f"(it holds {self.n_past}): replay the history from position 0"
        )

    def drop_rewinds(self, before: int | None = None, lost: bool = False) -> None:
        """Free the copies keep_rewind kept (a step continuing where the last one ended),
        or those of positions before `before` only; `lost`: taken by another session."""
        self.rewind_lost = lost or (self.rewind_lost and before is not None)
        if self.rewinds:
            pool = self._live()
            for at, slot in list(self.rewinds.items()):
                if before is None or at < before:
                    del pool.states.rewinds[slot], self.rewinds[at]
                    pool.states.free.append(slot)

    def _drop_mark(self) -> None:
        pool = self._live()
        if self.mark is not None:
            del pool.states.marked[self.mark]
            pool.states.free.append(self.mark)
            self.mark = None

    def truncate(self, n: int) -> None:
        """Forget positions >= n (a replay after failover, or a rejected draft)."""
        if not 0 <= n <= self.n_past:
            raise InputError(f"cannot truncate to {n}: the session holds {self.n_past} positions")
        if (
            self.pool is not None
            and self.pool.recurrent
            and 0 < n < self.n_past
            and not self._rewind(n)
        ):
            self._cannot_go_back(n)
        self._check_window(n)
        self.n_past = n

    def _check_window(self, start: int) -> None:
        """Refuse to continue at `start` once the ring has overwritten the window before it.

        A chunk from `start` reads window pages from (start - n_swa + 1) // PAGE; the ring
        holds pages from ring_top - ring + 1, and the chunk's own writes never evict its
        window (ring_pages), so only what was written before matters."""
        pool = self.pool
        if pool is None or not pool.window_layers or start == 0:
            return
        if pool.window_from(start) < self._ring_low():
            kept = self._ring_low() * PAGE
            raise InputError(
                f"the sliding-window layers no longer hold the positions before "
                f"{start} (their ring keeps positions from {kept}): replay the "
                "history from position 0"
            )

    def close(
        self, scope: Hashable = None, keep: Sequence[bytes] = (), ids: Sequence[int] | None = None
    ) -> None:
        """Free the session; its first len(keep) full pages go to the prefix cache under
        `keep` (keys of its tokens, page_keys) for `scope`, with their token ids if given."""
        if self.pool is not None:
            if keep and self.pool.prefix is not None:
                n = min(len(keep), self.n_past // PAGE)
                if self.pool.recurrent:  # a kept run ends where a state was copied
                    m = self.mark_at // PAGE if self.mark is not None else 0
                    n = m if m <= n else 0
                low = self._ring_low() if self.pool.window_layers else n
                window = [self.ring[j % self.pool.ring] for j in range(low, n)]
                self.pool.prefix.store(scope, keep[:n], self.pages[:n], ids, low, window)
                if self.pool.recurrent and n and self.mark is not None:
                    del self.pool.states.marked[self.mark]
                    self.pool.prefix.store_state(scope, keep[n - 1], self.mark)
                    self.mark = None
                self.pages = self.pages[n:]
                self.ring = [page for page in self.ring if page not in window]
            if self.mark is not None:
                self._drop_mark()
            self.drop_rewinds()
            self.pool._give(self.pages, self.ring)
            self.pages, self.ring = [], []
            if self.state is not None:
                self.pool.states.free.append(self.state)
                self.state = None
            self.pool = None

    def _ring_low(self) -> int:
        """The first window page the ring still holds."""
        return max(self.ring_from, self.ring_top - self._live().ring + 1)

    def _live(self) -> KVPool:
        if self.pool is None:
            raise InputError("the session is closed")
        return self.pool

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
