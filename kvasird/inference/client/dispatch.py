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

Every request carries, for each gateway whose session rows are in it, that gateway's
signed delegation to this stage (the one its open carried, or this node's own for rows of
no session) and how many of the rows are its: the worker computes nothing without them.
A worker that has not admitted us lately takes only small frames (rpc.Intake): a
request too large for one is preceded by its first row alone, which gets us admitted.

Experts the stage selects often enough are cached and computed here (HotExperts): planned
so that whole selections become local, because a layer whose rows need even one remote
expert still costs the round trip.

A worker that fails or times out is marked unfit and the call is re-planned on
another replica. With probability `spot_check` a call is recomputed: on our own copy
of those experts when we hold one (authoritative), else on a second replica, with a
third deciding a disagreement. A worker out of tolerance is caught (spotcheck): it is
marked unfit and accused on gossip, its units for the session are taken out of the
stage's Close tally (the gateway pays it nothing for the session), and the evidence is
kept on this node; a call drawn that nobody else can recompute is counted as unchecked.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from kvasird.compute.experts import ExpertShard, ExpertWorker, dispatch
from kvasird.errors import WireError
from kvasird.inference.client.choice import ExpertChoice
from kvasird.inference.client.hotcache import HotExperts
from kvasird.inference.client.routing import (
    AVOIDED_MS,
    Fitness,
    Latency,
    PeerHoldings,
    cover_experts,
    expert_holders,
)
from kvasird.inference.client.spotcheck import SpotChecks, divergence
from kvasird.inference.errors import HopFailed, NoWorkers, Refusal, sentence
from kvasird.inference.protocol import EXPERT_PROTOCOL
from kvasird.inference.protocol.delegation import Issuer
from kvasird.inference.protocol.experts import ADMITTED_S, ExpertRequest, Outputs, selections
from kvasird.inference.server.engine import INLINE_TOKENS, run_short
from kvasird.inference.stepcontext import COMPANY, TALLY
from kvasird.inference.transport.channel import Channels
from kvasird.logs import get_logger
from kvasird.wire.rpc import SMALL_FRAME

MAX_ATTEMPTS = 4
LAST_RESORT_PAUSE_S = 0.25
"""The wait before sending rows to a worker that failed lately (the last resort)."""
_Part = tuple[np.ndarray, np.ndarray, bytes]
"""One session's rows for a worker: (rows, global ids, its gateway's delegation)."""
Piece = tuple[str, int, int, int, int]
"""(worker, first expert, end, the worker's advertised range start e0, its end)."""
LocalExperts = Callable[[int, int], "tuple[ExpertWorker, int, int] | None"]
"""(layer, expert) -> our own worker holding that expert of the layer and the global range
[first, end) it holds, if any."""
log = get_logger("kvasird.inference.client.dispatch")


class ExpertDispatcher:
    """Computes expert ranges this node lacks on the workers that hold them."""

    def __init__(
        self,
        issuer: Issuer,
        holders: Callable[[], list[PeerHoldings]],
        channels: Channels,
        latency: Latency,
        fitness: Fitness,
        local: LocalExperts,
        *,
        timeout_s: float,
        wire_dtype: str,
        spot_check: float,
        tolerance: float,
        hot: HotExperts | None = None,
        accuse: Callable[[str, str], Awaitable[None]] | None = None,
        window_s: float = 0.0,
        spot: SpotChecks | None = None,
        choice: ExpertChoice | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.issuer, self.me = issuer, issuer.peer_id
        self.holders, self.channels, self.local = holders, channels, local
        self.accuse, self.clock = accuse, clock
        self.hot = hot or HotExperts(None, 0, 0)
        self.latency, self.fitness = latency, fitness
        self.timeout_s, self.wire_dtype = timeout_s, wire_dtype
        self.tolerance = tolerance
        self.spot = spot or SpotChecks(0.0, spot_check, tolerance)
        """Draws the calls checked (at its experts' rate); keeps the evidence of workers
        caught and the ranges nobody else holds."""
        self.choice = choice
        """Told each worker's round trip; counts per layer what answered (remote, cache)."""
        self.window_s = window_s
        """Longest the rows of one session wait for other interleaved sessions' (remote)."""
        self._outgoing: dict[tuple[str, int, int, int], _Outgoing] = {}
        self._admitted: dict[str, float] = {}
        """Worker -> when it last answered us (on `clock`): within ADMITTED_S / 2 it still
        takes our large frames."""
        self.selected: Counter[tuple[int, int]] = Counter()
        """(layer, expert) -> times selected since the last load report."""
        self.stats = Counter[str]()
        """calls, rows, coalesced (sessions' rows that went in another's message),
        failovers, spot_checks, caught, unresolved, hot_rows, hot_fetched (cached experts
        whose bytes came from peers)."""

    def shard(self, layer: int, first: int, end: int) -> ExpertShard:
        """Experts [first, end) of `layer` on other peers: awaited from the event loop
        (`acall`), or called from a stage's worker thread (`call`, which enters the loop)."""

        async def acall(lay: int, rows: np.ndarray, sel: np.ndarray) -> np.ndarray:
            return await self.compute(lay, first, end, rows, sel)

        return ExpertShard(
            first, end, lambda lay, rows, sel: trio.from_thread.run(acall, lay, rows, sel), acall
        )

    async def compute(
        self, layer: int, first: int, end: int, rows: np.ndarray, sel: np.ndarray
    ) -> np.ndarray:
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
                log.info(
                    "expert worker replaced",
                    peer=exc.peer,
                    layer=layer,
                    reason=exc.reason[:200],
                    attempt=attempt + 1,
                )
                continue
            if strikes := self.fitness.strikes:  # the workers that answered work again
                for peer in {p[0] for p in pieces} & strikes.keys():
                    self.fitness.healthy(peer)
            for peer in {p[0] for p in pieces if not self.fitness.fit(p[0])}:
                self.fitness.pardon(peer)  # avoided, asked as the last resort: it answered
            if self.choice is not None:
                whole = all(p[0] == self.me for p in pieces)
                self.choice.count(layer, "cache" if whole else "remote")
            return _combine(layer, rows, gids, pieces, outs)
        raise NoWorkers(
            f"experts [{first}, {end}) of layer {layer} failed on {MAX_ATTEMPTS} workers"
        )

    async def _attempt(
        self, layer: int, first: int, end: int, rows: np.ndarray, gids: np.ndarray
    ) -> tuple[list[Piece], list[np.ndarray]]:
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

    async def _call_all(
        self, layer: int, shards: list[tuple[Piece, np.ndarray, np.ndarray]]
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
            mine = [
                (i, held.enter_context(self.hot.using((layer, s[0][3]))))
                for i, s in enumerate(shards)
                if s[0][0] == self.me
            ]
            async with trio.open_nursery() as nursery:
                for i in remote:
                    nursery.start_soon(one, i)
                for i, worker in mine:
                    (_, lo, _, e0, _), r, sel = shards[i]
                    self.stats["hot_rows"] += len(r)
                    outs[i] = await run_short(
                        [worker],
                        len(r) <= INLINE_TOKENS and not remote,
                        worker,
                        layer,
                        r,
                        sel.astype(np.int64) + lo - e0,
                    )
        if failed:
            raise failed[0]
        return [o for o in outs if o is not None]

    def _plan(self, layer: int, first: int, end: int, gids: np.ndarray) -> list[Piece] | None:
        """Our cached experts first, then the cheapest cover of the range by fit workers:
        each id goes to the first piece holding it (compute.dispatch), so what we cache is
        computed here and the rest goes to each worker as one message; without one, a cover
        through workers that failed once. None when nothing can take every id."""
        ours = [
            (self.me, e, e + 1, e, e + 1)
            for lay, e in sorted(self.hot.workers)
            if lay == layer and first <= e < end
        ]
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
            expert_holders([h for h in others if fitness.second_chance(h.peer)], layer, first, end),
            first,
            end,
            lambda p: self.latency(p) + (0.0 if fitness.fit(p) else AVOIDED_MS),
        )
        if cover is None:
            return None
        log.info(
            "no fit worker holds the experts: asking ones that failed lately",
            layer=layer,
            avoided=sorted({c[0] for c in cover if not fitness.fit(c[0])}),
        )
        return ours + cover

    async def checked(
        self, peer: str, e0: int, layer: int, rows: np.ndarray, gids: np.ndarray
    ) -> np.ndarray:
        """A worker's outputs; with probability `spot_check` verified against a judge.

        Our own copy of the experts is an authoritative judge. A second replica is not:
        when it disagrees, a third opinion decides who is out of tolerance, and without
        one the disagreement is only counted (nobody is sentenced on a coin toss).
        """
        out = await self.remote(peer, e0, layer, rows, gids)
        spot = self.spot
        if not spot.draw(spot.experts, peer):
            return out
        self.stats["spot_checks"] += 1
        unit = self._unit(peer, e0, layer, gids)
        own = self.local(layer, int(gids.min()))
        if own is not None and own[1] <= int(gids.min()) and int(gids.max()) < own[2]:
            worker, first, _ = own
            ref = await run_short(
                [worker], len(rows) <= INLINE_TOKENS, worker, layer, rows, gids - first
            )
            if spot.compared(spot.experts, divergence(out, ref)):
                return out
            await self._caught(peer, unit, [self.me], rows, out, ref)
            return ref
        others = self._replicas(layer, gids, exclude={peer})
        if not others:
            spot.nobody(spot.experts, unit)
            return out
        # The auditor is drawn, not the fastest: a liar slower than its replicas would
        # otherwise never be asked (and a CI run caught no one once, for that reason).
        others.insert(0, others.pop(spot.rng.randrange(len(others))))
        second, s_e0 = others[0]
        ref = await self.remote(second, s_e0, layer, rows, gids)
        if spot.compared(spot.experts, divergence(out, ref)):
            return out
        if len(others) < 2:
            self.stats["unresolved"] += 1
            spot.experts.unresolved += 1
            log.warning(
                "spot check disagreement without a third replica",
                peer=peer,
                other=second,
                layer=layer,
            )
            return out
        judge = await self.remote(others[1][0], others[1][1], layer, rows, gids)
        if self._close(out, judge):
            await self._caught(second, unit, [peer, others[1][0]], rows, ref, judge)
            return out
        await self._caught(peer, unit, [second, others[1][0]], rows, out, judge)
        if not self._close(ref, judge):
            await self._caught(second, unit, [others[1][0]], rows, ref, judge)
        return judge

    async def _caught(
        self,
        peer: str,
        unit: str,
        checkers: list[str],
        rows: np.ndarray,
        out: np.ndarray,
        ref: np.ndarray,
    ) -> None:
        """`peer` answered `out` where the judges computed `ref`: nothing it computed for
        this session is reported in the stage's Close tally, it is avoided, accused on
        gossip, and the evidence is kept."""
        self.stats["caught"] += 1
        tally = TALLY.get()
        if tally is not None:
            tally.experts.pop(peer, None)
        self.spot.caught("experts", peer, unit, checkers, rows, out, ref, divergence(out, ref))
        reason = f"spot check failed on {unit}"
        self.fitness.mark(peer, reason)
        log.warning("worker failed a spot check: marked unfit", peer=peer, unit=unit)
        if self.accuse is not None:
            await self.accuse(peer, reason)

    def _close(self, a: np.ndarray, b: np.ndarray) -> bool:
        return divergence(a, b) <= self.tolerance

    def _unit(self, peer: str, e0: int, layer: int, gids: np.ndarray) -> str:
        """The range `peer` holds that a call to it computed, as the status page names it
        (one name per range, however many calls)."""
        lo, hi = int(gids.min()), int(gids.max()) + 1
        e1 = next(
            (
                b
                for p, a, b in expert_holders(self.holders(), layer, lo, hi)
                if p == peer and a == e0
            ),
            hi,
        )
        return f"experts {e0}-{e1 - 1} of layer {layer}"

    def _replicas(self, layer: int, gids: np.ndarray, exclude: set[str]) -> list[tuple[str, int]]:
        lo, hi = int(gids.min()), int(gids.max()) + 1
        fit = [
            h
            for h in self.holders()
            if h.peer not in exclude and h.peer != self.me and self.fitness.fit(h.peer)
        ]
        found = [
            (p, e0) for p, e0, e1 in expert_holders(fit, layer, lo, hi) if e0 <= lo and hi <= e1
        ]
        return sorted(found, key=lambda r: self.latency(r[0]))

    async def remote(
        self, peer: str, e0: int, layer: int, rows: np.ndarray, gids: np.ndarray
    ) -> np.ndarray:
        """One worker call: rows and local ids (global - e0, e0 the start of the range the
        worker advertises, sent along so a worker can check it) out, outputs back; the
        work (the experts the rows selected) is counted to the session the step computes
        for, whose gateway's delegation goes with the rows (ours, for no session).
        """
        tally = TALLY.get()
        if tally is not None and not tally.delegation:
            raise Refusal(
                "bad",
                "the session's gateway sent no delegation when it opened it: "
                "expert workers compute none of its rows without one "
                "(upgrade the gateway)",
            )
        out = await self._remote(
            peer,
            e0,
            layer,
            rows,
            gids,
            tally.delegation if tally is not None else self.issuer.own(),
        )
        if tally is not None:
            tally.experts[peer] += selections(gids)
        return out

    async def _remote(
        self, peer: str, e0: int, layer: int, rows: np.ndarray, gids: np.ndarray, delegation: bytes
    ) -> np.ndarray:
        """The call of ``remote``, for the session `delegation` is for.

        While other sessions' decode steps are interleaved on this node's stages, the rows
        of several of them for one worker and layer go as one message: the first waits up
        to `window_s` for the others to reach the layer (one request, one reply, one ggml
        call on the worker instead of one each)."""
        company = COMPANY.get()
        others = company.now - 1 if company is not None else 0
        part = (rows, gids, delegation)
        if self.window_s <= 0 or others <= 0:
            return (await self._send(peer, e0, layer, [part]))[0]
        key = (peer, e0, layer, gids.shape[1])
        joining = self._outgoing.get(key)
        if joining is not None:
            at = len(joining.parts)
            joining.parts.append(part)
            if len(joining.parts) >= joining.want:
                joining.full.set()
            await joining.done.wait()
            if joining.error is not None:
                raise joining.error
            if joining.outs is None:  # the first gave up waiting (it was cancelled): go alone
                return (await self._send(peer, e0, layer, [part]))[0]
            return joining.outs[at]
        batch = self._outgoing[key] = _Outgoing(others + 1, [part])
        try:
            with trio.move_on_after(self.window_s):
                await batch.full.wait()
            del self._outgoing[key]  # what joined goes now; later rows start their own
            batch.outs = await self._send(peer, e0, layer, batch.parts)
            self.stats["coalesced"] += len(batch.parts) - 1
            return batch.outs[0]
        except HopFailed as exc:
            batch.error = exc
            raise
        finally:
            if self._outgoing.get(key) is batch:
                del self._outgoing[key]
            batch.done.set()

    async def _send(self, peer: str, e0: int, layer: int, parts: list[_Part]) -> list[np.ndarray]:
        """Each part's outputs, from one request whose rows go grouped by delegation (each
        group announced in ``for``, in the order of the rows)."""
        first: dict[bytes, int] = {}
        for _, _, d in parts:
            first.setdefault(d, len(first))
        order = sorted(range(len(parts)), key=lambda i: first[parts[i][2]])
        groups: Counter[bytes] = Counter()
        for _, g, d in parts:
            groups[d] += len(g)
        rows = np.concatenate([parts[i][0] for i in order]) if len(parts) > 1 else parts[0][0]
        gids = np.concatenate([parts[i][1] for i in order]) if len(parts) > 1 else parts[0][1]
        out = await self._request(peer, e0, layer, rows, gids, list(groups.items()))
        bounds = np.cumsum([len(parts[i][0]) for i in order])[:-1]
        outs = dict(zip(order, np.split(out, bounds), strict=True))
        return [outs[i] for i in range(len(parts))]

    async def _request(
        self,
        peer: str,
        e0: int,
        layer: int,
        rows: np.ndarray,
        gids: np.ndarray,
        groups: list[tuple[bytes, int]],
    ) -> np.ndarray:
        """One request; to a worker that has not admitted us lately, a request too large
        for its small frames goes as its first row alone, then the rest."""
        itemsize = 2 if self.wire_dtype == "f16" else 4
        if (
            len(rows) > 1
            and rows.size * itemsize + gids.size * 4 > SMALL_FRAME // 2
            and self.clock() - self._admitted.get(peer, -math.inf) > ADMITTED_S / 2
        ):
            rest = [(groups[0][0], groups[0][1] - 1)] if groups[0][1] > 1 else []
            head = await self._request(peer, e0, layer, rows[:1], gids[:1], [(groups[0][0], 1)])
            tail = await self._request(peer, e0, layer, rows[1:], gids[1:], rest + groups[1:])
            return np.concatenate([head, tail])
        msg = ExpertRequest(layer, e0, rows, gids - e0, tuple(groups), self.wire_dtype).to_wire()
        began = time.perf_counter()
        try:
            reply = await self.channels.request(peer, EXPERT_PROTOCOL, msg, self.timeout_s)
        except HopFailed:
            self._admitted.pop(peer, None)  # it may have restarted: small frames first again
            raise
        self._admitted[peer] = self.clock()
        ms = (time.perf_counter() - began) * 1000
        self.latency.observe(peer, ms)
        if self.choice is not None:
            self.choice.observed(peer, len(rows), ms)
        self.stats["calls"] += 1
        self.stats["rows"] += len(rows)
        try:
            out = Outputs.from_wire(reply).out
        except WireError as exc:  # a malformed answer is a failed worker
            raise HopFailed(peer, f"bad expert output: {exc}") from None
        if out.shape != (len(rows), gids.shape[1], rows.shape[1]):
            raise HopFailed(
                peer,
                f"bad expert output: shape {list(out.shape)} for "
                f"{len(rows)} rows of {gids.shape[1]} experts",
            )
        return out


@dataclass
class _Outgoing:
    """Rows of concurrent sessions for one worker, layer and width, going as one message."""

    want: int
    """Sessions stepping when the first came: the message goes once this many joined."""
    parts: list[_Part]
    """Each session's part, in the order they joined."""
    full: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    outs: list[np.ndarray] | None = None
    error: HopFailed | None = None


def _combine(
    layer: int, rows: np.ndarray, gids: np.ndarray, pieces: list[Piece], outs: list[np.ndarray]
) -> np.ndarray:
    """compute.dispatch's second pass: the same split, fed the workers' answers in order."""
    answers = iter(outs)
    return dispatch(
        layer,
        rows,
        gids,
        [ExpertShard(lo, hi, lambda *_: next(answers)) for _, lo, hi, _, _ in pieces],
    )
