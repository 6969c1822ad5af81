"""Remote expert dispatch, on the stage side: replicas by latency, failover, spot checks.

A window stage's MoE layer whose experts it does not hold ends its graph at the router
(router authority: the ids and weights are decided here) and calls an ExpertShard per
missing range. Our shard is awaited by a decode step running on the event loop (or
entered from a worker thread computing a prefill); it takes the current holders, covers
the range with the cheapest fit workers, and sends each only its rows and *its* local ids:

    stage ─ dispatch(rows, global ids) ─▶ piece [lo, hi) on worker W (holds [e0, e1))
                                                   ids - e0 ─▶ "/kvasir/experts/1" ─▶ W
                                      combine ◀── outputs [m, n, n_embd] ◀──────────┘

While several sessions' decode steps are interleaved on this node's stages, the rows of
those that reach a layer within `window_s` of each other go to a worker as one message
(the worker also batches messages from different stages into one ggml call).

Experts the stage selects often enough are cached and computed here (HotExperts): planned
so that whole selections become local, because a layer whose rows need even one remote
expert still costs the round trip.

A worker that fails or times out is marked unfit and the call is re-planned on
another replica. With probability `spot_check` a call is recomputed: on our own copy
of those experts when we hold one (authoritative), else on a second replica, with a
third deciding a disagreement; a worker out of tolerance is marked unfit.
"""


from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from kvasird.compute.experts import ExpertShard, ExpertWorker, dispatch
from kvasird.errors import WireError
from kvasird.inference.client.hotcache import HotExperts
from kvasird.inference.client.routing import (
    AVOIDED_MS,
    Fitness,
    Latency,
    PeerHoldings,
    cover_experts,
    expert_holders,
)
from kvasird.inference.errors import HopFailed, NoWorkers, sentence
from kvasird.inference.protocol import EXPERT_PROTOCOL
from kvasird.inference.protocol.experts import ExpertRequest, Outputs
from kvasird.inference.server.engine import INLINE_TOKENS, run_short
from kvasird.inference.stepcontext import COMPANY, TALLY
from kvasird.inference.transport.channel import Channels
from kvasird.logs import get_logger

MAX_ATTEMPTS = 4
LAST_RESORT_PAUSE_S = 0.25
"""The wait before sending rows to a worker that failed lately (the last resort)."""
Piece = tuple[str, int, int, int, int]
"""(worker, first expert, end, the worker's advertised range start e0, its end)."""
LocalExperts = Callable[[int, int], "tuple[ExpertWorker, int, int] | None"]
"""(layer, expert) -> our own worker holding that expert of the layer and the global range
[first, end) it holds, if any."""
log = get_logger("kvasird.inference.client.dispatch")



class ExpertDispatcher:
    """Computes expert ranges this node lacks on the workers that hold them."""

    def __init__(self, me: str, holders: Callable[[], list[PeerHoldings]], channels: Channels,
                 latency: Latency, fitness: Fitness, local: LocalExperts, *, timeout_s: float,
                 wire_dtype: str, spot_check: float, tolerance: float,
                 hot: HotExperts | None = None,
                 accuse: Callable[[str, str], Awaitable[None]] | None = None,
                 window_s: float = 0.0) -> None:
        self.me, self.holders, self.channels, self.local = me, holders, channels, local
        self.accuse = accuse
        self.hot = hot or HotExperts(None, 0, 0)
        self.latency, self.fitness = latency, fitness
        self.timeout_s, self.wire_dtype = timeout_s, wire_dtype
        self.spot_check, self.tolerance = spot_check, tolerance
        self.window_s = window_s
        """Longest the rows of one session wait for other interleaved sessions' (remote)."""
        self._outgoing: dict[tuple[str, int, int, int], _Outgoing] = {}
        self.selected: Counter[tuple[int, int]] = Counter()
        """(layer, expert) -> times selected since the last load report."""
        self.stats = Counter[str]()
        """calls, rows, coalesced (sessions' rows that went in another's message),
        failovers, spot_checks, caught, unresolved, hot_rows, hot_fetched (cached experts
        whose bytes came from peers)."""
        self._rng = random.Random()

    def shard(self, layer: int, first: int, end: int) -> ExpertShard:
        """Experts [first, end) of `layer` on other peers: awaited from the event loop
        (`acall`), or called from a stage's worker thread (`call`, which enters the loop)."""
        async def acall(lay: int, rows: np.ndarray, sel: np.ndarray) -> np.ndarray:
            return await self.compute(lay, first, end, rows, sel)

        return ExpertShard(first, end,
                           lambda lay, rows, sel: trio.from_thread.run(acall, lay, rows, sel),
                           acall)

    async def compute(self, layer: int, first: int, end: int, rows: np.ndarray,
                      sel: np.ndarray) -> np.ndarray:
        """Outputs for shard-local ids `sel`, with failover."""
        gids = sel.astype(np.int64) + first
        for g in np.unique(gids):
            self.selected[(layer, int(g))] += int((gids == g).any(axis=1).sum())
        for attempt in range(MAX_ATTEMPTS):
            try:
                pieces, outs = await self._attempt(layer, first, end, rows, gids)
            except HopFailed as exc:
                self.fitness.failed(exc.peer, exc.reason, sentence(exc))
                self.stats["failovers"] += 1
                log.info("expert worker replaced", peer=exc.peer, layer=layer,
                         reason=exc.reason[:200], attempt=attempt + 1)
                continue
            if strikes := self.fitness.strikes:  # the workers that answered work again
                for peer in {p[0] for p in pieces} & strikes.keys():
                    self.fitness.healthy(peer)
            for peer in {p[0] for p in pieces if not self.fitness.fit(p[0])}:
                self.fitness.pardon(peer)  # avoided, asked as the last resort: it answered
            return _combine(layer, rows, gids, pieces, outs)
        raise NoWorkers(f"experts [{first}, {end}) of layer {layer} failed on "
                        f"{MAX_ATTEMPTS} workers")

    async def _attempt(self, layer: int, first: int, end: int, rows: np.ndarray,
                       gids: np.ndarray) -> tuple[list[Piece], list[np.ndarray]]:
        """On the event loop: plan the pieces, split the rows, call every worker at once.

        The split is compute.dispatch's own: a pass with recording shards collects each
        piece's rows and ids; the thread's second pass with the answers combines them.
        """
        await self.hot.observe(layer, gids)
        pieces = self._plan(layer, first, end, gids)
        if pieces is None:
            raise NoWorkers(f"no fit worker holds experts [{first}, {end}) of layer {layer}")
        if any(not self.fitness.fit(p[0]) for p in pieces if p[0] != self.me):
            await trio.sleep(LAST_RESORT_PAUSE_S)  # what made it fail may pass meanwhile
        asked: list[tuple[Piece, np.ndarray, np.ndarray]] = []

        def recorder(piece: Piece) -> ExpertShard:
            def record(lay: int, r: np.ndarray, sel: np.ndarray) -> np.ndarray:
                asked.append((piece, r, sel))
                return np.zeros((len(r), sel.shape[1], r.shape[1]), np.float32)
            return ExpertShard(piece[1], piece[2], record)

        dispatch(layer, rows, gids, [recorder(p) for p in pieces])
        return pieces, await self._call_all(layer, asked)

    async def _call_all(self, layer: int, shards: list[tuple[Piece, np.ndarray, np.ndarray]]
                        ) -> list[np.ndarray]:
        """Every piece's outputs, in order. The workers' requests go out first; our cached
        experts compute meanwhile, in a thread while any request is out (the loop must stay
        free to send them and take the answers: computed in place first, they would add
        their time to the round trip), in place when the layer is wholly ours."""
        outs: list[np.ndarray | None] = [None] * len(shards)
        failed: list[HopFailed] = []
        remote = [i for i, s in enumerate(shards) if s[0][0] != self.me]

        async def one(i: int) -> None:
            (peer, lo, _, e0, _), r, sel = shards[i]
            try:
                outs[i] = await self.checked(peer, e0, layer, r, sel.astype(np.int64) + lo)
            except HopFailed as exc:
                failed.append(exc)

        with contextlib.ExitStack() as held:  # ours stay cached until computed
            mine = [(i, held.enter_context(self.hot.using((layer, s[0][3]))))
                    for i, s in enumerate(shards) if s[0][0] == self.me]
            async with trio.open_nursery() as nursery:
                for i in remote:
                    nursery.start_soon(one, i)
                for i, worker in mine:
                    (_, lo, _, e0, _), r, sel = shards[i]
                    self.stats["hot_rows"] += len(r)
                    outs[i] = await run_short([worker], len(r) <= INLINE_TOKENS and not remote,
                                              worker, layer, r, sel.astype(np.int64) + lo - e0)
        if failed:
            raise failed[0]
        return [o for o in outs if o is not None]

    def _plan(self, layer: int, first: int, end: int, gids: np.ndarray) -> list[Piece] | None:
        """Our cached experts first, then the cheapest cover of the range by fit workers:
        each id goes to the first piece holding it (compute.dispatch), so what we cache is
        computed here and the rest goes to each worker as one message; without one, a cover
        through workers that failed once. None when nothing can take every id."""
        ours = [(self.me, e, e + 1, e, e + 1) for lay, e in sorted(self.hot.workers)
                if lay == layer and first <= e < end]
        fitness = self.fitness
        others = [h for h in self.holders() if h.peer != self.me]
        fit = [h for h in others if fitness.fit(h.peer)]
        cover = cover_experts(expert_holders(fit, layer, first, end), first, end, self.latency)
        if cover is not None:
            return ours + cover
        mine = {e for _, e, _, _, _ in ours}
        if ours and all(int(g) in mine for g in gids.flat):
            return ours
        # the last resort, as a route's: workers avoided after failing once (one that timed
        # out on its first call, or refused while it reloaded) beat failing the step
        cover = cover_experts(
            expert_holders([h for h in others if fitness.second_chance(h.peer)], layer, first,
                           end), first, end,
            lambda p: self.latency(p) + (0.0 if fitness.fit(p) else AVOIDED_MS))
        if cover is None:
            return None
        log.info("no fit worker holds the experts: asking ones that failed lately", layer=layer,
                 avoided=sorted({c[0] for c in cover if not fitness.fit(c[0])}))
        return ours + cover

    async def checked(self, peer: str, e0: int, layer: int, rows: np.ndarray,
                      gids: np.ndarray) -> np.ndarray:
        """A worker's outputs; with probability `spot_check` verified against a judge.

        Our own copy of the experts is an authoritative judge. A second replica is not:
        when it disagrees, a third opinion decides who is out of tolerance, and without
        one the disagreement is only counted (nobody is sentenced on a coin toss).
        """
        out = await self.remote(peer, e0, layer, rows, gids)
        if self.spot_check <= 0 or self._rng.random() >= self.spot_check:
            return out
        self.stats["spot_checks"] += 1
        own = self.local(layer, int(gids.min()))
        if own is not None and own[1] <= int(gids.min()) and int(gids.max()) < own[2]:
            worker, first, _ = own
            ref = await run_short([worker], len(rows) <= INLINE_TOKENS, worker, layer, rows,
                                  gids - first)
            if self._close(out, ref):
                return out
            await self._caught(peer, layer)
            return ref
        others = self._replicas(layer, gids, exclude={peer})
        if not others:
            return out
        # The auditor is drawn, not the fastest: a liar slower than its replicas would
        # otherwise never be asked (and a CI run caught no one once, for that reason).
        others.insert(0, others.pop(self._rng.randrange(len(others))))
        second, s_e0 = others[0]
        ref = await self.remote(second, s_e0, layer, rows, gids)
        if self._close(out, ref):
            return out
        if len(others) < 2:
            self.stats["unresolved"] += 1
            log.warning("spot check disagreement without a third replica", peer=peer,
                        other=second, layer=layer)
            return out
        judge = await self.remote(others[1][0], others[1][1], layer, rows, gids)
        if self._close(out, judge):
            await self._caught(second, layer)
            return out
        await self._caught(peer, layer)
        if not self._close(ref, judge):
            await self._caught(second, layer)
        return judge

    async def _caught(self, peer: str, layer: int) -> None:
        self.stats["caught"] += 1
        reason = f"spot check failed on layer {layer}"
        self.fitness.mark(peer, reason)
        log.warning("worker failed a spot check: marked unfit", peer=peer, layer=layer)
        if self.accuse is not None:
            await self.accuse(peer, reason)

    def _close(self, a: np.ndarray, b: np.ndarray) -> bool:
        scale = max(float(np.abs(b).max()), 1e-6)
        return float(np.abs(a - b).max()) / scale <= self.tolerance

    def _replicas(self, layer: int, gids: np.ndarray, exclude: set[str]) -> list[tuple[str, int]]:
        lo, hi = int(gids.min()), int(gids.max()) + 1
        fit = [h for h in self.holders() if h.peer not in exclude and h.peer != self.me
               and self.fitness.fit(h.peer)]
        found = [(p, e0) for p, e0, e1 in expert_holders(fit, layer, lo, hi)
                 if e0 <= lo and hi <= e1]
        return sorted(found, key=lambda r: self.latency(r[0]))

    async def remote(self, peer: str, e0: int, layer: int, rows: np.ndarray,
                     gids: np.ndarray) -> np.ndarray:
        """One worker call: rows and local ids (global - e0, e0 the start of the range the
        worker advertises, sent along so a worker can check it) out, outputs back; the
        work (the experts the rows selected) is counted to the session the step computes
        for.
        """
        tally = TALLY.get()
        out = await self._remote(peer, e0, layer, rows, gids,
                                 tally.owner if tally is not None else self.me)
        if tally is not None:
            tally.experts[peer] += _selections(gids)
        return out

    async def _remote(self, peer: str, e0: int, layer: int, rows: np.ndarray,
                      gids: np.ndarray, owner: str) -> np.ndarray:
        """The call of ``remote``, for the session of gateway ``owner``.

        While other sessions' decode steps are interleaved on this node's stages, the rows
        of several of them for one worker and layer go as one message: the first waits up
        to `window_s` for the others to reach the layer (one request, one reply, one ggml
        call on the worker instead of one each)."""
        company = COMPANY.get()
        others = company.now - 1 if company is not None else 0
        if self.window_s <= 0 or others <= 0:
            return await self._request(peer, e0, layer, rows, gids, {owner})
        key = (peer, e0, layer, gids.shape[1])
        joining = self._outgoing.get(key)
        if joining is not None:
            at = len(joining.parts)
            joining.parts.append((rows, gids))
            joining.owners.add(owner)
            if len(joining.parts) >= joining.want:
                joining.full.set()
            await joining.done.wait()
            if joining.error is not None:
                raise joining.error
            if joining.outs is None:  # the first gave up waiting (it was cancelled): go alone
                return await self._request(peer, e0, layer, rows, gids, {owner})
            return joining.outs[at]
        batch = self._outgoing[key] = _Outgoing(others + 1, [(rows, gids)], {owner})
        try:
            with trio.move_on_after(self.window_s):
                await batch.full.wait()
            del self._outgoing[key]  # what joined goes now; later rows start their own
            out = await self._request(peer, e0, layer,
                                      np.concatenate([r for r, _ in batch.parts]),
                                      np.concatenate([g for _, g in batch.parts]),
                                      batch.owners)
            bounds = np.cumsum([len(r) for r, _ in batch.parts])[:-1]
            batch.outs = np.split(out, bounds)
            self.stats["coalesced"] += len(batch.parts) - 1
            return batch.outs[0]
        except HopFailed as exc:
            batch.error = exc
            raise
        finally:
            if self._outgoing.get(key) is batch:
                del self._outgoing[key]
            batch.done.set()

    async def _request(self, peer: str, e0: int, layer: int, rows: np.ndarray,
                       gids: np.ndarray, owners: set[str]) -> np.ndarray:
        msg = ExpertRequest(layer, e0, rows, gids - e0, tuple(sorted(owners)),
                            self.wire_dtype).to_wire()
        began = time.perf_counter()
        reply = await self.channels.request(peer, EXPERT_PROTOCOL, msg, self.timeout_s)
        self.latency.observe(peer, (time.perf_counter() - began) * 1000)
        self.stats["calls"] += 1
        self.stats["rows"] += len(rows)
        try:
            out = Outputs.from_wire(reply).out
        except WireError as exc:  # a malformed answer is a failed worker
            raise HopFailed(peer, f"bad expert output: {exc}") from None
        if out.shape != (len(rows), gids.shape[1], rows.shape[1]):
            raise HopFailed(peer, f"bad expert output: shape {list(out.shape)} for "
                                  f"{len(rows)} rows of {gids.shape[1]} experts")
        return out


@dataclass
class _Outgoing:
    """Rows of concurrent sessions for one worker, layer and width, going as one message."""

    want: int
    """Sessions stepping when the first came: the message goes once this many joined."""
    parts: list[tuple[np.ndarray, np.ndarray]]
    """(rows, global ids) of each, in the order they joined."""
    owners: set[str]
    """The gateways whose sessions the rows are for (the worker checks each)."""
    full: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    outs: list[np.ndarray] | None = None
    error: HopFailed | None = None


def _selections(gids: np.ndarray) -> int:
    """Experts the rows actually selected: rows are padded with repeats of their first id
    (compute.experts packs them), and a row never selects an expert twice."""
    if len(gids) == 1:
        return len(set(gids[0].tolist()))
    ordered = np.sort(gids, axis=1)
    return int(len(ordered) + np.count_nonzero(np.diff(ordered, axis=1)))


def _combine(layer: int, rows: np.ndarray, gids: np.ndarray, pieces: list[Piece],
             outs: list[np.ndarray]) -> np.ndarray:
    """compute.dispatch's second pass: the same split, fed the workers' answers in order."""
    answers = iter(outs)
    return dispatch(layer, rows, gids, [ExpertShard(lo, hi, lambda *_: next(answers))
                                        for _, lo, hi, _, _ in pieces])

