"""The KV cache: one bounded pool per stage, handed to sessions in pages.

Each held attention layer has a K and a V tensor of `n_slots` token slots (a sliding-window
layer fewer, below). A session owns a list of pages of PAGE slots; position p lives in
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

A gated delta-net layer (the Qwen3.5 hybrids) keeps no KV: its session state is a fixed
size, the convolution's last inputs and the delta rule's matrices, and it lives here too,
one row per state slot of `cache_conv.N` and `cache_delta.N`. A session takes a slot when
it first runs and gives it back when it closes, so the same limits and expiry cover it.
Such a state only moves forward: a session can continue where it is or start again at
position 0 (a replay rebuilds it), never rewind in between.

A sliding-window layer (gemma3, gpt-oss) reads only the hp.n_swa newest positions, so it
keeps only those, as llama.cpp's bounded cache does: its K and V live in a second, smaller
set of pages, the window pool, and a session holds a ring of at most `ring` of them, where
window position p lives in ring[(p // PAGE) % ring]. A ring is exactly enough for the
longest chunk a graph computes plus the window before it (`ring_pages`), so a chunk's new
positions never overwrite ones its own queries read. Attention gathers the ring pages that
hold the chunk's windows in position order and masks them by the positions they really
hold: a whole number of pages from a page boundary, so each position keeps its place
modulo PAGE, every SIMD lane of the softmax and of the V product sums the same terms in
the same order as over the whole context, and masked slots add exact zeros; the logits
are bitwise those of a full cache. A ring grows page by page like the session, so a short
session takes only what its length needs. The window pool holds `KVSpec.window_sessions`
whole rings (at most as many pages as the main pool); `free_tokens` counts what a new
session could get from both pools, and a session that cannot get a ring page gets
KVCacheFull.

A ring forgets: a session can go back to a position only while the window before it is
still in the ring (a rejected draft, a rewind shorter than about a chunk); beyond that it
must replay the history from position 0. `KVSpec.swa_full` keeps every position of those
layers in the main pool instead, llama.cpp's swa_full: any rewind, at a full layer's
memory. A model without sliding-window layers has no window pool.

Prefix reuse. Agents send the same long system prompt and history on every call, so a
pool keeps the full pages of closed sessions (PrefixCache) and a new session whose tokens
begin the same way starts from them:

    tokens ─▶ page_keys: key[i] = H(key[i-1], tokens of page i)  (computed by the gateway,
              which alone sees every token; a stage behind the first sees hidden rows only)
    open:  Session.attach(scope, keys) ─▶ the longest run key[0..m) the cache holds ─▶
           those pages, shared (a reference each), n_past = m * PAGE
    step:  reserve(start) first gives up the shared pages at or after `start` (a fresh page
           each, the part before `start` copied: copy-on-write), so a session writes only
           pages it alone holds
    close: Session.close(keep) hands its first len(keep) full pages to the cache under keep

Pages are reference-counted: a session holds one reference to each of its pages, the cache
one to each it keeps. The cache only ever holds pages nobody else needs: a session that
cannot get a free page evicts the least recently used cached page that no session shares,
so cached pages cost no admission (`free_tokens` counts them as free) and no memory beyond
the pool. Lookups and stores touch a chain from its last page to its first, so eviction
takes a chain's tail first and its head stays reachable. Keys are scoped by the caller
(the stage server scopes them by the session's owner and hop): a cached page serves only
sessions of the peer whose session wrote it, so a peer that lies about its keys poisons
only its own prefixes.

Sliding-window layers keep no pages of the prefix, only a ring of its last window and
chunk. A closing session hands its ring's pages to the cache too (_KeptRing), filed under
the key of every page boundary m whose window, the pages a chunk from m * PAGE reads, it
holds: the last ~chunk of positions. A new session starts from the longest run of kept
pages that ends at such a boundary: the main pool's pages shared as above, that window
copied into a ring of its own (a few pages, so no copy-on-write there). Agents resend
their whole history, which runs on from the last call's session (its end, or where the
next call's template first renders the answer differently from the tokens generated), so
the run they need ends in the kept ring; a prompt that shares only the start of another's
(a common system prompt, then other turns) finds no window there and prefills from 0.
Kept rings cost no admission either: a session short of window pages evicts the least
recently used.

A delta-net layer's state is not paged: it holds everything before the session's position
at once and cannot go back. So a session copies its state into a second slot of the pool,
its mark, each time it reaches a page boundary (the stage computes every run in pieces that
end on page boundaries, stage.PREFILL_PIECE, and a decode step reaches the next one), and a
closing session hands the cache its pages up to the mark and the mark itself, filed under
the mark's page key. A new session starts from the longest kept run that ends at a kept
state: the attention layers' pages shared as above, the state copied into its own slot.
Marks and kept states cost no admission: a session short of a state slot takes a kept
state's, or else a live session's mark (that session then keeps no prefix).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

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
    window_sessions: int = 8
    """Sessions whose sliding-window layers can hold a whole ring at once (models with
    sliding-window layers): the window pool's size in rings, at most the main pool's pages."""
    swa_full: bool = False
    """Keep every position of the sliding-window layers in the main pool, masked to the
    window (llama.cpp's swa_full): a full layer's memory, but a session can go back anywhere."""


KEY_BYTES = 16
"""Bytes of one page key (blake2b-128): collisions are out of reach for any number of pages."""


def page_keys(tokens: Sequence[int]) -> bytes:
    """The chain keys of the full pages of `tokens`, concatenated: key i (KEY_BYTES) names
    page i's tokens and everything before them, so equal keys mean equal positions 0.. the
    page's end."""
    ids = np.asarray(tokens, dtype="<i4")
    out, key = bytearray(), b""
    for i in range(len(ids) // PAGE):
        key = hashlib.blake2b(key + ids[i * PAGE:(i + 1) * PAGE].tobytes(),
                              digest_size=KEY_BYTES).digest()
        out += key
    return bytes(out)


def split_keys(keys: bytes) -> list[bytes]:
    """page_keys' output as a list of keys (a length not a multiple of KEY_BYTES: InputError)."""
    if len(keys) % KEY_BYTES:
        raise InputError(f"page keys come in {KEY_BYTES}-byte units, got {len(keys)} bytes")
    return [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]


def ring_pages(n_swa: int, n_tokens: int) -> int:
    """Pages a chunk of n_tokens queries reads through a window of n_swa positions: the run
    of n_swa + n_tokens - 1 positions from its first query's window to its last query
    touches at most this many, however it falls on page boundaries."""
    return -(-(n_swa + n_tokens - 2) // PAGE) + 1


class KVPool:
    """K and V tensors for `layers`, and the free lists of pages."""

    def __init__(self, backend: Backend, hp: HParams, layers: range, spec: KVSpec, *,
                 chunk: int) -> None:
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
            () if spec.swa_full else
            (layer for layer in layers if hp.is_swa(layer) and not hp.is_recurrent(layer)))
        """Sliding-window layers whose KV lives in the window pool."""
        self.ring = ring_pages(hp.n_swa, chunk) if self.window_layers else 0
        """Window-pool pages of a whole ring."""
        self.n_window_pages = min(n_pages, spec.window_sessions * self.ring)
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
        self._free_states = list(range(spec.state_slots - 1, -1, -1)) if self.conv else []
        self._marked: dict[int, Session] = {}
        """State slots holding a live session's mark, and that session."""
        self.max_session_tokens = spec.max_session_tokens or self.n_slots

    @property
    def recurrent(self) -> bool:
        """Whether the pool holds delta-net layers (sessions then keep a state slot)."""
        return bool(self.conv)

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
        return max(0, start - self.n_swa + 1) // PAGE

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
        return len(self._free_states) + kept + len(self._marked)

    def open(self) -> Session:
        return Session(self)

    def _take(self) -> int:
        if not self._free and self.prefix is not None:
            self.prefix.evict()
        if not self._free:
            raise KVCacheFull(f"the KV pool is full ({self.n_slots} slots): close idle sessions "
                              "or raise the pool size")
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
        if not self._free_states and self.prefix is not None:
            self.prefix.evict_state()
        if not self._free_states and self._marked:  # a live session's mark gives way
            next(iter(self._marked.values()))._drop_mark()
        if not self._free_states:
            raise KVCacheFull(f"all {self.spec.state_slots} recurrent-state slots are in use: "
                              "close idle sessions or raise the number of state slots")
        return self._free_states.pop()

    def _copy_state(self, src: int, dst: int) -> None:
        """Copy state slot `src`'s convolution and delta-rule states into slot `dst`."""
        for t in (*self.conv.values(), *self.delta.values()):
            row = int(t.contents.nb[1])
            buf = (ctypes.c_uint8 * row)()
            ggml.ggml_backend_tensor_get(t, buf, src * row, row)
            ggml.ggml_backend_tensor_set(t, buf, dst * row, row)

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

    def reserve(self, start: int, n_tokens: int) -> None:
        """Make room for positions [start, start + n_tokens), dropping cached positions >= start."""
        pool = self._live()
        if not 0 <= start <= self.n_past:
            raise InputError(f"position {start} is past the cached context ({self.n_past} tokens): "
                             "send the missing tokens first")
        if pool.recurrent and 0 < start < self.n_past:
            raise InputError(f"a recurrent state cannot go back to position {start} "
                             f"(it holds {self.n_past}): replay the history from position 0")
        self._check_window(start)
        end = start + n_tokens
        if end > pool.max_session_tokens:
            raise KVCacheFull(f"{end} tokens exceed the session limit of {pool.max_session_tokens}")
        need = -(-end // PAGE) - len(self.pages) + self._shared_from(start)
        if need > len(pool._free) and need > pool.free_pages:  # counting kept pages: rarely
            raise KVCacheFull(f"the KV pool has {pool.free_pages * PAGE} free slots, this "
                              f"request needs {need * PAGE} more: close idle sessions or raise "
                              "the pool size")
        need_ring = max(0, min(-(-end // PAGE), pool.ring) - len(self.ring))
        if need_ring > pool.free_window_pages:
            raise KVCacheFull(f"the sliding-window pool has {pool.free_window_pages * PAGE} free "
                              f"slots, this request needs {need_ring * PAGE} more: close idle "
                              "sessions or raise the number of window sessions")
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
                pool._clear_state(self.state)
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
                pool._copy_state(state, self.state)
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
        return sum(pool._refs[p] > 1 for p in self.pages[start // PAGE:])

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

    def window_chunk(self, start: int, end: int, n_pages: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What the window layers of a graph computing positions [start, end) write and read:
        the window-pool slots those positions go to; the ring pages holding the queries'
        windows in position order, padded to `n_pages` with the first; and the position each
        slot of those pages holds (padding: past every query, so masked). From here on the
        ring counts [start, end) as written, the graph about to run may write them."""
        pool = self._live()
        ring = np.asarray(self.ring, np.int64)
        pos = np.arange(start, end, dtype=np.int64)
        slots = ring[(pos // PAGE) % pool.ring] * PAGE + pos % PAGE
        held = np.arange(max(0, start - pool.n_swa + 1) // PAGE, (end - 1) // PAGE + 1)
        pages = np.full(n_pages, ring[held[0] % pool.ring], np.int32)
        pages[:len(held)] = ring[held % pool.ring]
        positions = np.full(n_pages * PAGE, np.iinfo(np.int64).max, np.int64)
        positions[:len(held) * PAGE] = (held[:, None] * PAGE + np.arange(PAGE)).ravel()
        self.ring_top = max(self.ring_top, int(held[-1]))
        return slots, pages, positions

    def advance(self, end: int) -> None:
        self.n_past = end
        if self.state is not None and end % PAGE == 0 and self.pool is not None:
            self._mark(end)

    def _mark(self, end: int) -> None:
        """Copy the state, which now holds positions [0, end), into the session's mark: a
        slot no one else needs (a kept state's at most), else none is taken."""
        pool = self._live()
        if self.mark is None:
            if not pool._free_states and pool.prefix is not None:
                pool.prefix.evict_state()
            if not pool._free_states:
                return
            self.mark = pool._free_states.pop()
            pool._marked[self.mark] = self
        assert self.state is not None
        pool._copy_state(self.state, self.mark)
        self.mark_at = end

    def _drop_mark(self) -> None:
        pool = self._live()
        if self.mark is not None:
            del pool._marked[self.mark]
            pool._free_states.append(self.mark)
            self.mark = None

    def truncate(self, n: int) -> None:
        """Forget positions >= n (a replay after failover, or a rejected draft)."""
        if not 0 <= n <= self.n_past:
            raise InputError(f"cannot truncate to {n}: the session holds {self.n_past} positions")
        if self.pool is not None and self.pool.recurrent and 0 < n < self.n_past:
            raise InputError(f"a recurrent state cannot be truncated to {n} of {self.n_past} "
                             "positions: replay the history from position 0")
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
            raise InputError(f"the sliding-window layers no longer hold the positions before "
                             f"{start} (their ring keeps positions from {kept}): replay the "
                             "history from position 0")

    def close(self, scope: Hashable = None, keep: Sequence[bytes] = (),
              ids: Sequence[int] | None = None) -> None:
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
                    del self.pool._marked[self.mark]
                    self.pool.prefix.store_state(scope, keep[n - 1], self.mark)
                    self.mark = None
                self.pages = self.pages[n:]
                self.ring = [page for page in self.ring if page not in window]
            if self.mark is not None:
                self._drop_mark()
            self.pool._give(self.pages, self.ring)
            self.pages, self.ring = [], []
            if self.state is not None:
                self.pool._free_states.append(self.state)
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


@dataclass(eq=False)
class _KeptRing:
    """A closed session's window-pool pages, holding its window pages low, low + 1, ...
    in position order, and the prefix keys filed to them: the page boundaries whose window
    they hold."""

    low: int
    pages: list[int]
    ends: list[tuple[Hashable, bytes]] = field(default_factory=list)


class PrefixCache:
    """Closed sessions' full pages by (scope, prefix key), least recently used first, and
    in a pool with window layers their rings (_KeptRing).

    Holds one reference to each page it keeps (KVPool._refs); gives a page back when a
    session needs room and no session shares it, a ring when a session needs window
    pages."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._pages: OrderedDict[tuple[Hashable, bytes], tuple[int, np.ndarray | None]] = \
            OrderedDict()
        self._rings: OrderedDict[_KeptRing, None] = OrderedDict()
        """Kept rings, least recently used first."""
        self._ends: dict[tuple[Hashable, bytes], tuple[_KeptRing, int]] = {}
        """Key of page m - 1 -> the ring holding the window a chunk from m * PAGE reads, m."""
        self.states: OrderedDict[tuple[Hashable, bytes], int] = OrderedDict()
        """Key of page m - 1 -> a state slot holding the delta-net states at m * PAGE,
        least recently used first."""
        self.hits = 0
        """Pages sessions started from (since the pool was made)."""

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def ring_pages(self) -> int:
        """Window-pool pages the kept rings hold (all free for the taking)."""
        return sum(len(ring.pages) for ring in self._rings)

    @property
    def evictable(self) -> int:
        """Cached pages no session shares: free for the taking."""
        refs = self.pool._refs
        return sum(refs[page] == 1 for page, _ in self._pages.values())

    def lookup(self, scope: Hashable, keys: Sequence[bytes]
               ) -> tuple[list[int], np.ndarray | None, _KeptRing | None, int | None]:
        """The pages of the longest run of `keys` held for `scope` (with window layers: the
        longest whose window a kept ring holds; with delta-net layers: the longest that
        ends at a kept state), each with a reference taken for the caller, their token ids
        (None unless every page kept them), that ring (None without window layers) and
        that state's slot (None without delta-net layers)."""
        found: list[tuple[int, np.ndarray | None]] = []
        for key in keys:
            hit = self._pages.get((scope, key))
            if hit is None:
                break
            found.append(hit)
        kept = None
        if self.pool.window_layers:
            while found and (scope, keys[len(found) - 1]) not in self._ends:
                found.pop()
            if found:
                kept = self._ends[scope, keys[len(found) - 1]][0]
                self._rings.move_to_end(kept)
        state = None
        if self.pool.recurrent:
            while found and (scope, keys[len(found) - 1]) not in self.states:
                found.pop()
            if found:
                self.states.move_to_end((scope, keys[len(found) - 1]))
                state = self.states[scope, keys[len(found) - 1]]
        for key in reversed(keys[:len(found)]):  # the chain's head becomes the freshest
            self._pages.move_to_end((scope, key))
        pages = [page for page, _ in found]
        for page in pages:
            self.pool._refs[page] += 1
        self.hits += len(pages)
        ids = None
        if found and all(i is not None for _, i in found):
            ids = np.concatenate([i for _, i in found])
        return pages, ids, kept, state

    def store_state(self, scope: Hashable, key: bytes, slot: int) -> None:
        """Keep state slot `slot` (handed over) under `key`, the key of the page it ends;
        a key already held keeps its state (the same positions) and `slot` is freed."""
        if (scope, key) in self.states:
            self.pool._free_states.append(slot)
        else:
            self.states[scope, key] = slot
        self.states.move_to_end((scope, key))

    def evict_state(self) -> None:
        """Free the least recently used kept state's slot."""
        if self.states:
            _, slot = self.states.popitem(last=False)
            self.pool._free_states.append(slot)

    def store(self, scope: Hashable, keys: Sequence[bytes], pages: Sequence[int],
              ids: Sequence[int] | None, low: int = 0, window: Sequence[int] = ()) -> None:
        """Keep `pages` (the caller's references, handed over) under `keys`, and with window
        layers the ring pages `window` (handed over, holding window pages low, low + 1, ...),
        filed under every key whose window they hold. A key already held keeps its page
        (the same one, from an attach, or another session's copy of the same positions:
        then the caller's page is freed), and its ring."""
        for i in range(len(pages) - 1, -1, -1):
            key, page = (scope, keys[i]), pages[i]
            held = self._pages.get(key)
            if held is None:
                page_ids = None if ids is None or len(ids) < (i + 1) * PAGE else \
                    np.asarray(ids[i * PAGE:(i + 1) * PAGE], np.int32)
                self._pages[key] = (page, page_ids)
            else:
                self.pool._release(page)
            self._pages.move_to_end(key)
        if not self.pool.window_layers:
            return
        ring = _KeptRing(low, list(window))
        for m in range(len(pages), 0, -1):
            if self.pool.window_from(m * PAGE) < low:
                break
            end = (scope, keys[m - 1])
            if end not in self._ends:
                self._ends[end] = (ring, m)
                ring.ends.append(end)
        if ring.ends:
            self._rings[ring] = None
        else:
            self.pool._free_window.extend(ring.pages)

    def evict(self) -> bool:
        """Free the least recently used page no session shares; False when there is none."""
        refs = self.pool._refs
        for key, (page, _) in self._pages.items():
            if refs[page] == 1:
                del self._pages[key]
                self.pool._release(page)
                self._drop_end(key)  # a run through it can no longer be found
                return True
        return False

    def evict_ring(self) -> None:
        """Free the least recently used kept ring's window pages."""
        if self._rings:
            ring = next(iter(self._rings))
            for end in list(ring.ends):
                self._drop_end(end)

    def _drop_end(self, key: tuple[Hashable, bytes]) -> None:
        entry = self._ends.pop(key, None)
        if entry is None:
            return
        ring = entry[0]
        ring.ends.remove(key)
        if not ring.ends:
            del self._rings[ring]
            self.pool._free_window.extend(ring.pages)
