"""The sliding-window ring: where a window layer's positions live, and what a chunk reads.

A sliding-window layer (gemma3, gpt-oss) reads only the hp.n_swa newest positions, so it
keeps only those, as llama.cpp's bounded cache does: its K and V live in a second, smaller
set of pages, the window pool, and a session holds a ring of at most `ring` of them, where
window position p lives in ring[(p // PAGE) % ring]. A ring is exactly enough for the
longest chunk a graph computes plus the window before it (`ring_pages`), so a chunk's new
positions never overwrite ones its own queries read. Attention gathers the ring pages that
hold the chunk's windows in position order and masks them by the positions they really
hold (`ring_chunk`): a whole number of pages from a page boundary, so each position keeps
its place modulo PAGE, every SIMD lane of the softmax and of the V product sums the same
terms in the same order as over the whole context, and masked slots add exact zeros; the
logits are bitwise those of a full cache. A ring grows page by page like the session, so a
short session takes only what its length needs. The window pool holds
`KVSpec.window_sessions` whole rings (at most as many pages as the main pool);
`KVPool.free_tokens` counts what a new session could get from both pools, and a session
that cannot get a ring page gets KVCacheFull.

A ring forgets: a session can go back to a position only while the window before it is
still in the ring (a rejected draft, a rewind shorter than about a chunk); beyond that it
must replay the history from position 0. `KVSpec.swa_full` keeps every position of those
layers in the main pool instead, llama.cpp's swa_full: any rewind, at a full layer's
memory. A model without sliding-window layers has no window pool.

The window pool's free list and each session's ring live with the main pool's pages in
pool.py (one reservation covers both); this module is the ring's arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvasird.compute.kv.keys import PAGE


def ring_pages(n_swa: int, n_tokens: int) -> int:
    """Pages a chunk of n_tokens queries reads through a window of n_swa positions: the run
    of n_swa + n_tokens - 1 positions from its first query's window to its last query
    touches at most this many, however it falls on page boundaries."""
    return -(-(n_swa + n_tokens - 2) // PAGE) + 1


def first_page(n_swa: int, start: int) -> int:
    """The first window page a chunk from position `start` reads."""
    return max(0, start - n_swa + 1) // PAGE


def ring_chunk(
    ring: Sequence[int], size: int, n_swa: int, start: int, end: int, n_pages: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the window layers of a graph computing positions [start, end) write and read
    through `ring` (window-pool pages of a ring of `size`): the window-pool slots those
    positions go to; the ring pages holding the queries' windows in position order, padded
    to `n_pages` with the first; and the position each slot of those pages holds (padding:
    past every query, so masked)."""
    pages_of = np.asarray(ring, np.int64)
    pos = np.arange(start, end, dtype=np.int64)
    slots = pages_of[(pos // PAGE) % size] * PAGE + pos % PAGE
    held = np.arange(first_page(n_swa, start), (end - 1) // PAGE + 1)
    pages = np.full(n_pages, pages_of[held[0] % size], np.int32)
    pages[: len(held)] = pages_of[held % size]
    positions = np.full(n_pages * PAGE, np.iinfo(np.int64).max, np.int64)
    positions[: len(held) * PAGE] = (held[:, None] * PAGE + np.arange(PAGE)).ravel()
    return slots, pages, positions
