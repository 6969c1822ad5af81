"""Batching at a stage: concurrent sessions' decode steps through the same chain of stages
compute together, one graph per stage (Stage.forward_batch), so each step reads the
weights once for all of them instead of once per session; short prompts (a new session's,
an agent's next turn after its kept prefix) join them, up to PROMPT_ROWS rows a batch.

    step ─▶ queue of its chain ─▶ leader: gathers the steps queued (waiting up to the
                                  window for the sessions of the last batch to join)
                                  ─▶ one forward_batch per stage, in a worker thread
                                  ─▶ each waiter's rows ─▶ the first step queued meanwhile
                                  leads the next batch

There is no task of its own: the first step to find its chain idle leads. While a batch
computes, the steps that arrive (the other sessions' next tokens, other routes' rows)
queue, so under load the batches fill by themselves; a lone session never waits and runs
as it did alone (in place when its stages are free). Only chains whose steps compute long
enough for batching to pay (_Queue.pays) batch at all; on others every step runs alone.
A step the batch refuses (a bad position, a full KV) runs alone and gets its own answer
while the batch goes on without it; a batch that fails as a whole runs its steps one by
one, so the good ones are not lost.

Prompts join because a prompt's few rows cost nearly what a decode step's one does alone
(the weights are read for them either way; bench/bench_scale.py --only prefill times a
batch of rows against one at real widths). Sixteen new sessions' prompts computed one by
one held up everyone's decode for sixteen such graphs; batched, they are a graph or two. A
prompt longer than a prefill piece, or crossing a piece's end, runs alone in its pieces
(Stage.forward), letting the batches of decode steps go between them.

The outputs equal the sessions' solo ones where the kernels compute a row the same way
in any batch (attention always: each session attends over its own pages; the quantized
matrix products of the bundled model too); where a kernel blocks rows differently they
agree to float rounding, within what a verifier's tolerance allows.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from kvasird.compute.errors import RunRefused
from kvasird.compute.stage import PREFILL_PIECE
from kvasird.logs import get_logger

if TYPE_CHECKING:
    from kvasird.compute.kv.pool import Session
    from kvasird.compute.stage import Stage
    from kvasird.inference.server.stage import ServedSession

log = get_logger("kvasird.inference.server")

PROMPT_ROWS = PREFILL_PIECE
"""The most rows of prompts (steps of more than one row) one batch takes: a prefill
piece's, so that a batch holds the stage about as long as a piece of a long prompt does."""

GATHER_MAX_S = 0.05
"""The longest a batch's leader waits for the sessions of the last batch to join."""

AWAY_WEIGHT = 0.1
"""Weight of the newest time in _Queue.away_s and _Queue.compute_s."""

SEEN_MIN_S = 0.1
"""A session counts as stepping on a chain for at least this long after its last step."""
SEEN_PRUNE = 256
"""Sessions remembered per chain before the ones that stopped stepping are forgotten."""

Solo = Callable[["ServedSession", np.ndarray, int], Awaitable[np.ndarray]]
"""How one step runs alone: (session, rows, start) -> its output."""


@dataclass(eq=False)
class _Waiter:
    s: ServedSession
    x: np.ndarray
    start: int
    woken: trio.Event = field(default_factory=trio.Event)
    told: str = ""
    """What the waiter is woken to do: "done" (its output is here), "lead" (gather and
    compute the next batch) or "solo" (its batch failed: run alone)."""
    out: np.ndarray | None = None

    def tell(self, what: str) -> None:
        self.told = what
        self.woken.set()


@dataclass(eq=False)
class _Queue:
    waiting: list[_Waiter] = field(default_factory=list)
    busy: bool = False
    """A leader is gathering or computing a batch of this chain."""
    joined: trio.Event = field(default_factory=trio.Event)
    compute_s: float = 0.0
    """How long a batch computes (a moving average)."""
    fastest: float = float("inf")
    """The shortest a step that ran alone has taken here per row (the least of them is a
    decode step's compute, the others' waits left out; a prompt's rows, which share their
    reads of the weights, each take less than a decode step: a bound from below, known
    from the first step, a new session's prompt)."""
    seen: dict[int, float] = field(default_factory=dict)
    """When each session (by id) last stepped here."""
    answered: dict[int, float] = field(default_factory=dict)
    """When each session's last batched step was answered."""
    away_s: float = 0.0
    """How long a session is away between an answer to a decode step and its next step
    here (a moving average): its gateway's turn on one node, the other hops of a ring.
    (After a prompt, a session may wait on its gateway for other things: the other
    sessions' prompts it sends first, a client's turn.)"""

    def arrive(self, s: object, now: float) -> None:
        if len(self.seen) >= SEEN_PRUNE:  # sessions that ended: forget them
            self.stepping(now)
        self.seen[id(s)] = now
        answered = self.answered.pop(id(s), None)
        if answered is not None:
            away = now - answered
            self.away_s += AWAY_WEIGHT * (away - self.away_s) if self.away_s else away

    def cap(self, max_rows: int, stepping: int) -> int:
        """The most steps one batch takes: every session stepping here where they come
        straight back (one node: the pipeline is one stage deep), a share of them where they
        are away for longer than a batch computes (a ring of D hops: D batches in flight
        keep every hop busy, where one batch of everyone would leave all hops but one
        idle)."""
        depth = max(1, round(1 + self.away_s / self.compute_s)) if self.compute_s else 1
        return max(1, min(max_rows, -(-stepping // depth)))

    def known(self) -> bool:
        """Whether a step has run alone here (so whether batching pays is known)."""
        return self.fastest < float("inf")

    def pays(self, min_step_s: float) -> bool:
        """Whether gathering a batch pays on this chain: its steps compute long enough (at
        least `min_step_s` alone) that reading the weights once for several sessions saves
        more than the wait, the thread hand-off and the pipelining it gives up (the
        sessions of one batch move through a ring's hops together). A 3-stage ring of the
        bundled model, whose hops are short, lost aggregate tokens/s when its hops batched
        everyone; one daemon of a 1B model, whose steps are long, gained (concurrent
        sessions in bench/bench_swarm.py and bench/bench_scale.py's sessions16)."""
        return self.known() and self.fastest >= min_step_s

    def stepping(self, now: float) -> int:
        """Sessions that stepped within the last few batches' time: the leader waits (see
        Batcher._gather) for as many."""
        since = now - max(SEEN_MIN_S, 3 * (self.compute_s + self.away_s))
        for key in [k for k, t in self.answered.items() if t < since]:
            del self.answered[key]
        for key in [k for k, t in self.seen.items() if t < since]:
            del self.seen[key]
        return len(self.seen)

    def hand_on(self) -> None:
        """The leader is done: the first step queued meanwhile leads the next batch."""
        if self.waiting:
            self.waiting[0].tell("lead")
        else:
            self.busy = False


class Batcher:
    """The decode-step queues of one stage server's chains."""

    def __init__(
        self,
        max_rows: int,
        window_s: float,
        min_step_s: float = 0.0,
        pipelined: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_rows, self.window_s, self.min_step_s = max_rows, window_s, min_step_s
        self.pipelined, self.clock = pipelined, clock
        """When steps arrive and are answered (which sessions count as stepping here); how
        long a step computes is measured on time.monotonic whatever the clock."""
        """Whether a batch takes only a share of the sessions of a deep ring (_Queue.cap)."""
        self._queues: dict[tuple[int, ...], _Queue] = {}
        self.stats = {"batches": 0, "rows": 0, "largest": 0, "prompts": 0, "refused": 0, "split": 0}
        """Batches of several sessions computed, their steps, the most steps in one, the
        prompts (steps of several rows) among them, steps a batch refused (they ran alone,
        the batch went on), and batches that failed as a whole and ran one by one."""

    def company(self) -> bool:
        """Whether several sessions step on a chain: then a forwarded step is worth a task
        of its own (StageServer.inline), so that the steps behind it in its stream can
        queue and join a batch (on a chain where gathering does not pay, those that queued
        while a step computed still go together)."""
        now = self.clock()
        return any(q.stepping(now) > 1 for q in self._queues.values())

    def takes(self, chain: list[Stage], start: int, rows: int) -> bool:
        """Whether a step of `rows` rows at `start` on `chain` batches: every stage can (no
        recurrent state) and none dispatches experts (those steps interleave on the event
        loop instead, their expert rows batched per worker); a decode step, or a prompt
        within one prefill piece (a longer one runs alone, piece by piece)."""
        if rows > 1 and (start + rows - 1) // PREFILL_PIECE != start // PREFILL_PIECE:
            return False
        # a batch computes a stage's offered layers (its fallback replica's) on it
        return self.max_rows > 1 and all(st.batches and not st.dispatches for st in chain)

    async def step(self, s: ServedSession, x: np.ndarray, start: int, solo: Solo) -> np.ndarray:
        """The output of one decode step of `s`, computed with the steps of other sessions
        on the same chain that queue with it."""
        key = tuple(id(st) for st in s.chain)
        queue = self._queues.setdefault(key, _Queue())
        queue.arrive(s, self.clock())
        me = _Waiter(s, x, start)
        queue.waiting.append(me)
        queue.joined.set()
        queue.joined = trio.Event()
        if queue.busy:
            try:
                await me.woken.wait()
            except BaseException:  # cancelled in the queue: leave it, and pass on a lead
                if me in queue.waiting:
                    queue.waiting.remove(me)
                if me.told == "lead":
                    queue.hand_on()
                raise
            if me.told == "done":
                assert me.out is not None
                return me.out
            if me.told == "solo":
                return await solo(s, x, start)
        queue.busy = True
        batch = [me]
        try:
            if not queue.pays(self.min_step_s) and len(queue.waiting) == 1:
                # gathering does not pay here (yet): alone, the steps arriving meanwhile
                # queue behind it; those that queued while the last step computed go as
                # one batch, for free (nobody waits for them)
                queue.waiting.remove(me)
                return await self._alone(queue, s, x, start, solo)
            if queue.pays(self.min_step_s):
                # the steps queued count whenever they came (behind a first prompt, say)
                stepping = max(queue.stepping(self.clock()), len(queue.waiting))
                cap = queue.cap(self.max_rows, stepping) if self.pipelined else self.max_rows
                want = min(stepping, cap)
                await self._gather(queue, want)
                batch = _take(queue.waiting, cap)
                if want <= 1 and len(batch) == 1:
                    return await self._alone(queue, s, x, start, solo)
            else:
                batch = _take(queue.waiting, self.max_rows)
            # in a worker thread even if alone now, so that the others' steps queue
            if me not in await self._compute(queue, list(batch)):
                assert me.out is not None
                return me.out
        finally:
            if me in queue.waiting:  # cancelled while gathering
                queue.waiting.remove(me)
            for w in batch:  # refused by the batch, or the leader was cancelled: each alone
                if w is not me and not w.woken.is_set():
                    w.tell("solo")
            queue.hand_on()
        return await solo(s, x, start)

    async def _alone(
        self, queue: _Queue, s: ServedSession, x: np.ndarray, start: int, solo: Solo
    ) -> np.ndarray:
        began = time.monotonic()
        try:
            return await solo(s, x, start)
        finally:
            queue.fastest = min(queue.fastest, (time.monotonic() - began) / len(x))

    async def _gather(self, queue: _Queue, want: int) -> None:
        """Wait for the steps of the sessions stepping here (their next tokens), up to the
        window or a fifth of the last batch's compute time if longer (at most
        GATHER_MAX_S): a lone session never waits, and a full queue does not either. Two
        half batches would read the weights twice."""
        if len(queue.waiting) >= want or self.window_s <= 0:
            return
        with trio.move_on_after(min(max(self.window_s, queue.compute_s / 5), GATHER_MAX_S)):
            while len(queue.waiting) < want:
                await queue.joined.wait()

    async def _compute(self, queue: _Queue, batch: list[_Waiter]) -> list[_Waiter]:
        """The batch through its chain as one graph per stage, each waiter told its rows;
        the waiters left to run alone: a step the batch refused (a bad position, a full
        KV: the others go on without it, so that one session cannot make every session it
        shares a batch with compute alone), or all of them when it failed as a whole."""
        alone: list[_Waiter] = []
        while batch:
            began = time.monotonic()
            try:
                outs = await trio.to_thread.run_sync(_forward_batch, batch)
            except RunRefused as exc:
                alone.append(batch.pop(exc.index))
                self.stats["refused"] += 1
                continue
            except Exception as exc:  # noqa: BLE001 - each step then answers for itself
                self.stats["split"] += 1
                log.debug(
                    "a batch of decode steps failed; running them one by one",
                    steps=len(batch),
                    error=repr(exc)[:200],
                )
                return alone + batch
            took, now = time.monotonic() - began, self.clock()
            queue.compute_s += AWAY_WEIGHT * (took - queue.compute_s) if queue.compute_s else took
            for w, out in zip(batch, outs, strict=True):
                w.out = out
                w.tell("done")
                if len(w.x) == 1:  # (a prompt's answer is not a ring's round: see away_s)
                    queue.answered[id(w.s)] = now
            if len(batch) > 1:
                self.stats["batches"] += 1
                self.stats["rows"] += len(batch)
                self.stats["largest"] = max(self.stats["largest"], len(batch))
                self.stats["prompts"] += sum(len(w.x) > 1 for w in batch)
            break
        return alone


def _take(waiting: list[_Waiter], cap: int) -> list[_Waiter]:
    """The next batch, out of the queue: up to `cap` steps in their order, the prompts
    among them up to PROMPT_ROWS rows in all (the first step always: it leads); the
    prompts passed over lead or join the next."""
    batch: list[_Waiter] = []
    rest: list[_Waiter] = []
    prompt_rows = 0
    for w in waiting:
        rows = len(w.x) if len(w.x) > 1 else 0
        if len(batch) < cap and (not batch or prompt_rows + rows <= PROMPT_ROWS):
            batch.append(w)
            prompt_rows += rows
        else:
            rest.append(w)
    waiting[:] = rest
    return batch


def _forward_batch(batch: list[_Waiter]) -> list[np.ndarray]:
    """Every stage of the chain once for the whole batch (in a worker thread)."""
    xs: list[Any] = [w.x for w in batch]
    chain = batch[0].s.chain
    for i, stage in enumerate(chain):
        runs: list[tuple[Session, np.ndarray, int]] = [
            (w.s.sessions[i], x, w.start) for w, x in zip(batch, xs, strict=True)
        ]
        xs = stage.forward_batch(runs)
    return xs
