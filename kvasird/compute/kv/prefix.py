"""Prefix reuse: closed sessions' pages kept by page key, for the next session that begins
the same way.

Agents send the same long system prompt and history on every call, so a pool keeps the
full pages of closed sessions (PrefixCache) and a new session whose tokens begin the same
way starts from them (the flow is drawn in the package docstring, kvasird/compute/kv).

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

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvasird.compute.kv.keys import PAGE

if TYPE_CHECKING:
    from kvasird.compute.kv.pool import KVPool


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
        self._pages: OrderedDict[tuple[Hashable, bytes], tuple[int, np.ndarray | None]] = (
            OrderedDict()
        )
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

    def lookup(
        self, scope: Hashable, keys: Sequence[bytes]
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
        for key in reversed(keys[: len(found)]):  # the chain's head becomes the freshest
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
            self.pool.states.free.append(slot)
        else:
            self.states[scope, key] = slot
        self.states.move_to_end((scope, key))

    def evict_state(self) -> None:
        """Free the least recently used kept state's slot."""
        if self.states:
            _, slot = self.states.popitem(last=False)
            self.pool.states.free.append(slot)

    def store(
        self,
        scope: Hashable,
        keys: Sequence[bytes],
        pages: Sequence[int],
        ids: Sequence[int] | None,
        low: int = 0,
        window: Sequence[int] = (),
    ) -> None:
        """Keep `pages` (the caller's references, handed over) under `keys`, and with window
        layers the ring pages `window` (handed over, holding window pages low, low + 1, ...),
        filed under every key whose window they hold. A key already held keeps its page
        (the same one, from an attach, or another session's copy of the same positions:
        then the caller's page is freed), and its ring."""
        for i in range(len(pages) - 1, -1, -1):
            key, page = (scope, keys[i]), pages[i]
            held = self._pages.get(key)
            if held is None:
                page_ids = (
                    None
                    if ids is None or len(ids) < (i + 1) * PAGE
                    else np.asarray(ids[i * PAGE : (i + 1) * PAGE], np.int32)
                )
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
