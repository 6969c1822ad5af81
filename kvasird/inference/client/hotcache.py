"""HotExperts: experts a stage computes itself to spare network round trips.

The dispatcher counts what each layer's rows select; once an expert has been selected
`after` times it is fetched from a holder and computed here, planned (``plan_cache``) so
that whole selections become local: a layer whose rows need even one remote expert still
costs the round trip. Bounded by `capacity` experts; an expert whose load failed is not
tried again for HOT_RETRY_S.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

import numpy as np
import trio

from kvasird.compute.experts import ExpertWorker
from kvasird.logs import get_logger

HOT_RETRY_S = 60.0
"""How long an expert the hot cache could not load (no holder answered) is not tried again."""
log = get_logger("kvasird.inference.client.hotcache")


class HotExperts:
    """Experts this stage computes itself to spare round trips: the hot-expert cache.

    A MoE layer costs a round trip unless *every* expert a row selects there is local, so
    the cache is planned by selection sets, not by each expert's popularity: under even
    routing (top-2 of 8) caching half the experts of two layers keeps 6 / 28 = 21 % of
    each layer's rows local, caching one whole layer keeps all of its rows local (half of
    the round trips gone instead of a fifth). The last `window` rows' selections are kept
    per layer; after every `after` selected rows per layer the cache is re-planned: each
    pick is the expert with the most credit, a row crediting each expert it still misses
    with 1 / (the experts it still misses), so a row one expert short counts whole.
    Planned experts are loaded one per call, in the background (fetched from their holders
    first when this node lacks their bytes, as a stage usually does); a cached
    one no longer planned is dropped when its room is needed and nothing computes on it.
    """

    def __init__(
        self,
        load: Callable[[int, int], Awaitable[ExpertWorker]] | None,
        capacity: int,
        after: int,
        window: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.load, self.capacity, self.after, self.window = load, capacity, after, window
        self.clock = clock
        """Times the HOT_RETRY_S wait of an expert whose load failed (a test's own clock)."""
        self.workers: dict[tuple[int, int], ExpertWorker] = {}
        self.planned: list[tuple[int, int]] = []
        """What the last plan wants cached, best first."""
        self._rows: dict[int, list[np.ndarray]] = {}
        self._kept: Counter[int] = Counter()
        self._since = 0
        self._busy: Counter[tuple[int, int]] = Counter()
        self._failed: dict[tuple[int, int], float] = {}
        """Experts whose load failed, by when: not tried again for HOT_RETRY_S."""
        self._loading: set[tuple[int, int]] = set()
        self.nursery: trio.Nursery | None = None
        """Where loads run while decode steps go on (the service's); without one, the
        step that wants an expert waits for its load."""

    async def observe(self, layer: int, gids: np.ndarray) -> None:
        """Record this call's selections; re-plan when it is time; load one planned expert
        that is not cached yet (`load` fetches its bytes when they are not here and reads
        them off the loop)."""
        if self.load is None or self.capacity <= 0:
            return
        kept = self._rows.setdefault(layer, [])
        kept.append(gids)
        self._kept[layer] += len(gids)
        if self._kept[layer] > 2 * self.window:
            self._rows[layer] = [stack_rows(kept)[-self.window :]]
            self._kept[layer] = self.window
        self._since += len(gids)
        if self._since >= self.after * len(self._rows):  # `after` rows per layer seen
            self._since = 0
            # ~0.1 s for 200 picks over 48 layers of top-8 selections: not on the loop
            self.planned = await trio.to_thread.run_sync(
                plan_cache,
                {lay: stack_rows(r)[-self.window :] for lay, r in self._rows.items()},
                self.capacity,
            )
        now = self.clock()
        want = next(
            (
                k
                for k in self.planned
                if k not in self.workers
                and k not in self._loading
                and now - self._failed.get(k, -math.inf) >= HOT_RETRY_S
            ),
            None,
        )
        if want is None:
            return
        if len(self.workers) + len(self._loading) >= self.capacity:
            spare = [k for k in self.workers if k not in self.planned and not self._busy[k]]
            if not spare:
                return
            self.drop(spare[0])
        self._loading.add(want)
        if self.nursery is not None:  # the decode step goes on meanwhile
            self.nursery.start_soon(self._load, want)
        else:
            await self._load(want)

    async def _load(self, key: tuple[int, int]) -> None:
        assert self.load is not None
        try:
            self.workers[key] = await self.load(*key)
            log.info("hot expert cached", layer=key[0], expert=key[1])
        except Exception as exc:  # noqa: BLE001 - no holder answered, no bytes: keep dispatching
            self._failed[key] = self.clock()
            log.info("hot expert not cached", layer=key[0], expert=key[1], error=repr(exc))
        finally:
            self._loading.discard(key)

    @contextlib.contextmanager
    def using(self, key: tuple[int, int]) -> Iterator[ExpertWorker]:
        """A cached expert's worker, kept while the caller computes on it."""
        worker = self.workers[key]
        self._busy[key] += 1
        try:
            yield worker
        finally:
            self._busy[key] -= 1

    def drop(self, key: tuple[int, int]) -> None:
        worker = self.workers.pop(key)
        worker.close()
        worker.weights.close()
        log.info("hot expert dropped", layer=key[0], expert=key[1])

    def close(self) -> None:
        for key in list(self.workers):
            self.drop(key)


def stack_rows(parts: list[np.ndarray]) -> np.ndarray:
    """Selection rows of several calls as one array: a call for part of a layer's range
    sends fewer ids per row (compute.experts pads a row with its first id), so narrower
    parts are padded the same way (a repeated id changes no plan: it is one expert)."""
    width = max(p.shape[1] for p in parts)
    return np.concatenate(
        [
            p
            if p.shape[1] == width
            else np.concatenate([p, np.repeat(p[:, :1], width - p.shape[1], 1)], 1)
            for p in parts
        ]
    )


def plan_cache(rows: dict[int, np.ndarray], capacity: int) -> list[tuple[int, int]]:
    """Up to `capacity` (layer, expert) keys that keep the most of `rows` (per layer, each
    row the experts one token selected) wholly local, picked greedily (HotExperts)."""
    if capacity <= 0 or not any(r.size for r in rows.values()):
        return []
    width = 1 + max(int(r.max()) for r in rows.values() if r.size)
    keys = stack_rows([lay * width + r.reshape(len(r), -1) for lay, r in rows.items() if r.size])
    picked = np.zeros(width * (1 + max(rows)), bool)
    plan: list[tuple[int, int]] = []
    while len(plan) < capacity:
        missing = ~picked[keys]
        short = missing.sum(axis=1)
        if not short.any():
            break
        credit = np.bincount(
            keys[missing],
            weights=np.repeat(1.0 / np.maximum(short, 1), short),
            minlength=picked.size,
        )
        best = int(credit.argmax())
        picked[best] = True
        plan.append((best // width, best % width))
    return plan
