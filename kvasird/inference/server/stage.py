"""StageServer: sessions on this node's stages, and the "/kvasir/stage/1" handler.

open (a session on [first, end) with embed/head), step (token ids or hidden rows at
positions start.. ─▶ hidden rows, or the sampled token at the last stage), close (with
the commitment to every step computed, server.ledger), ping, reveal (the steps' rows).
Sessions are keyed by (caller, session id), bounded in number and KV room (admission
refuses with "busy" and a reason), and closed when idle. A forwarded step computes and
hands its output to the next hop itself, or its result to the session's owner; a failure
on the way names the peer that failed (this node, the next hop, or the hop before it when
it sent rows that are not finite).

The handlers see only messages kvasird.inference.protocol.stage has parsed (``answer``;
channel.serve parses each frame as it is read, ``handle`` parses an in-process caller's);
what they check is what depends on this node: the model, its layers, a session's room.
Refusals are Refusal, with their code.

A step on a stage that dispatches experts runs as steps on the event loop, so the decode
steps of concurrent sessions interleave (see _run_chain); the step's context
(kvasird.inference.stepcontext) tells the expert dispatcher whose session it computes.
On other stages the decode steps of concurrent sessions through the same chain compute
as one graph per stage (server.batch).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import trio

from kvasird.compute.errors import ComputeError, InputError, KVCacheFull
from kvasird.compute.experts import ExpertShard, ExpertWorker, dispatch_steps
from kvasird.compute.kv.keys import PAGE, split_keys
from kvasird.compute.kv.pool import Session
from kvasird.compute.sampling import Sampler, log_softmax
from kvasird.compute.stage import Stage, held_now, locks_now
from kvasird.compute.steps import drive_async
from kvasird.errors import KvasirError, WireError
from kvasird.inference.api import TokenEvent
from kvasird.inference.errors import Code, HopFailed, NoWorkers, Refusal, Unreachable
from kvasird.inference.protocol.delegation import Verifier
from kvasird.inference.protocol.stage import (
    Close,
    Closed,
    Failure,
    Forward,
    Hidden,
    Open,
    Opened,
    Pong,
    Result,
    Reveal,
    Revealed,
    Shown,
    StageMessage,
    Step,
    parse,
    tokens_to_wire,
)
from kvasird.inference.protocol.tensors import DTYPES
from kvasird.inference.server.batch import Batcher
from kvasird.inference.server.engine import INLINE_TOKENS, Served, run_short
from kvasird.inference.server.ledger import Ledgers
from kvasird.inference.stepcontext import COMPANY, TALLY, Company, Tally
from kvasird.inference.steptrace import collecting_waits, waiting
from kvasird.logs import get_logger
from kvasird.text.grammar import Constraint, GrammarError, vocabulary

log = get_logger("kvasird.inference.server")

KEEP_TICKETS = 4096
"""Forwarded steps remembered, to drop the second copy of each (sent on two paths)."""
PART_WAIT_S = 30.0
"""Longest a row of a speculative step sent a row at a time (Step.part) waits for the rows
before it, or a step for such a step's rows to end (a hop that died mid-step)."""
CLOSE_WAIT_S = 5.0
"""Longest a Close or Reveal waits for such a step's last rows, which it records."""
STAGE_POLL_S = (0.0005, 0.008)
"""A decode step waiting for a stage a prefill holds looks again after the first delay,
doubling up to the second (a long prefill must not cost its waiters' CPU in wake-ups)."""


@dataclass
class Parts:
    """A speculative step coming to this hop a row at a time (Step.part), as far as it came.

    The hop before sends each row on as soon as it computed it, so every hop of the route
    computes a check's rows side by side with the others: a further row costs the route
    the slowest hop's compute, not every hop's one after another (about a third, on a
    3-hop ring). Rows are taken in order; a later one, or the next step, waits its turn.
    The head draws after each row and answers at the first draw that is not the next
    guess, takes the rows still coming without computing them, and records the step, as
    every hop does, once all its rows came: the ledger holds the same step as when the
    rows came together."""

    ticket: str
    start: int
    n: int
    received: list[np.ndarray] = field(default_factory=list)
    """The rows as they travelled, in order (the ledger's record of what came)."""
    rows: list[np.ndarray] = field(default_factory=list)
    """The rows widened (what a delta-net's replay goes back through)."""
    sent: list[np.ndarray] = field(default_factory=list)
    """The rows sent on, in the wire's type."""
    drawn: list[TokenEvent] = field(default_factory=list)
    """At the head: the tokens drawn."""
    answered: bool = False
    """At the head: the result is sent; the rows still coming are only recorded."""
    failed: bool = False
    """A row failed here: those after it are dropped (the owner was told once)."""
    complete: bool = False
    """All its rows came (or one failed): the session's next step may begin."""


@dataclass
class ServedSession:
    """One caller's session on a hop: a KV session per stage of the chain, and the sampler."""

    chain: list[Stage]
    """The stages the hop runs through, in order."""
    sessions: list[Session]
    """One per stage."""
    sampler: Sampler | None
    """Present when the hop ends at the head."""
    logprobs: int
    """Top alternatives to report per token (0 = none)."""
    max_tokens: int
    """Positions this session may reach (prompt + completion)."""
    prev: str = ""
    """The peer that may forward steps into this session (the hop before it), besides the
    owner."""
    at: int = 0
    """Positions computed so far (what a ping reports)."""
    history: list[int] = field(default_factory=list)
    """Token ids seen so far (the head's repetition penalty needs them)."""
    used: float = 0.0
    """Last use on the server's clock (set when opened and on every step), for idle
    expiry."""
    last_step: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """When the last step's compute began and ended (time.monotonic), and how long of it
    went to waiting for remote experts (s)."""
    tally: Tally = field(default_factory=lambda: Tally(""))
    """Whose session it is, and the expert work done for it on other peers."""
    scopes: list[Hashable] = field(default_factory=list)
    """Per stage, what its prefix cache files this session's pages under: the owner and
    the part it computes (a cached page serves only its owner's sessions on that part)."""
    out: str = "last"
    """What the head stage answers a step with (Stage.forward's `logits`): "last" (the
    logits the sampler draws from), "embd" (an embedding session: every row's final norm)."""
    guessed: tuple[int, np.ndarray] | None = None
    """(start, rows) of the last step a chain holding delta-net states computed one
    position at a time (a speculative step's): what a step going back into it replays."""
    parts: Parts | None = None
    """The last speculative step that came a row at a time (Step.part)."""
    moved: trio.Event = field(default_factory=trio.Event)
    """Set (and replaced) whenever a row of `parts` is taken: what waiting rows wait on."""

    @property
    def recurrent(self) -> bool:
        """Whether a stage of the chain holds delta-net states (which cannot go back)."""
        return any(st.kv.recurrent for st in self.chain)

    @property
    def layers(self) -> int:
        """Layers a position costs on this hop, as receipts count them (the head as one)."""
        return sum(st.window[1] - st.window[0] for st in self.chain) + any(
            st.head for st in self.chain
        )

    def attach(self, keys: bytes) -> int:
        """Start every stage's session from the longest prefix of `keys` it kept: the
        positions the hop starts with (the least of its stages'; 0 at a head that kept no
        token ids to restore the history with)."""
        keys_ = split_keys(keys)
        found = [
            s.attach(scope, keys_) for s, scope in zip(self.sessions, self.scopes, strict=True)
        ]
        cached, ids = min(n for n, _ in found), found[-1][1]
        if self.sampler is not None and cached and (ids is None or len(ids) < cached):
            cached = 0
        try:  # every stage from the same position (a window ring may not go back that far)
            for s in self.sessions:
                s.truncate(min(cached, s.n_past))
        except InputError:
            cached = 0
            for s in self.sessions:
                s.truncate(0)
        if cached and self.sampler is not None and ids is not None:
            self.history = ids[:cached].tolist()
        self.at = cached
        return cached

    def close(self, keep: bytes = b"") -> None:
        keys = split_keys(keep) if keep else []
        for s, scope in zip(self.sessions, self.scopes or [None] * len(self.sessions), strict=True):
            s.close(scope, keys, self.history if self.sampler is not None else None)


Admit = Callable[[str, int], Awaitable[None]]
"""(gateway peer, units of work about to be done for it) -> returns if this node does that
work for that gateway now (and meters it), else Refusal."""


async def admit_all(gateway: str, units: int) -> None:
    return None


Send = Callable[[str, dict[str, Any]], Awaitable[None]]
"""(peer, message in its wire form) -> sent one-way on the stage protocol (HopFailed when
it cannot be)."""
Deliver = Callable[[str, Result | Failure], None]
"""(sender, a forwarded chain's result) -> handed to the generation waiting for it."""


async def _cannot_send(peer: str, msg: dict[str, Any]) -> None:
    raise HopFailed(peer, "this stage server forwards to no one (not linked to a node)")


class StageServer:
    """Sessions on this node's stages, and the stage protocol's request handler."""

    def __init__(
        self,
        model_id: Callable[[], str],
        served: Callable[[], Served | None],
        *,
        max_sessions: int,
        idle_s: float,
        wire_dtype: str,
        me: str = "",
        send: Send = _cannot_send,
        deliver: Deliver | None = None,
        admit: Admit = admit_all,
        prefix: bool = True,
        batch_rows: int = 16,
        batch_window_s: float = 0.001,
        batch_min_s: float = 0.0,
        batch_pipelined: bool = True,
        clock: Callable[[], float] = time.monotonic,
        delegations: Verifier | None = None,
    ) -> None:
        self.model_id, self.served, self.admit = model_id, served, admit
        self.delegations = delegations
        """Checks the owner's delegation of a session that opens with its first step (none:
        such opens are refused)."""
        self.clock = clock
        """Idle expiry, which sessions count as stepping for batching, and how long closed
        sessions' ledgers are kept (a test's own clock)."""
        self.prefix = prefix
        """Keep closed sessions' prompts for reuse ([inference] prefix_cache)."""
        self.max_sessions, self.idle_s, self.wire_dtype = max_sessions, idle_s, wire_dtype
        self.me, self.send, self.deliver = me, send, deliver
        self.sessions: dict[tuple[str, str], ServedSession] = {}
        self._ended = trio.Event()
        self.tokens = 0
        """Token positions computed since the last load report."""
        self.forwarded = 0
        """Steps whose output this node forwarded to the next hop or returned to its owner."""
        self.replayed = 0
        """Positions recomputed to go back into a speculative step where no copy of a
        delta-net state was kept there (_go_back)."""
        self.rows_apart = 0
        """Rows of speculative steps that came here a row at a time (Parts), since start."""
        self._tickets: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        """The latest forwarded steps' (owner, session, ticket): a second copy is dropped."""
        self.twins = 0
        """Second copies of forwarded steps dropped, since start."""
        self.company = Company()
        """Decode steps interleaved on this node's stages now (for the expert dispatcher)."""
        self.batcher = Batcher(batch_rows, batch_window_s, batch_min_s, batch_pipelined, clock)
        """Concurrent sessions' decode steps through one chain, computed as one graph per
        stage ([inference] batch_sessions)."""
        self.ledgers = Ledgers(clock=clock)
        """Every session's steps as computed: committed to at close, shown on Reveal."""

    async def handle(self, caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        """A message in its wire form (from a caller in this process): parsed, answered."""
        return await self.answer(caller, parse(msg))

    async def answer(self, caller: str, m: StageMessage) -> dict[str, Any]:
        """The reply to a parsed message, in its wire form."""
        if isinstance(m, Step):
            if m.forward is not None:
                await self._forwarded(caller, m, m.forward)
                return {}
            # the session first: a stranger's rows are never widened (tensors.widen)
            key = (caller, m.sid)
            out = await self._step(self._session(key), m.widened())
            sent = self._record(key, m, out)
            return (
                tokens_to_wire(out)
                if isinstance(out, tuple)
                else Hidden(sent, self.wire_dtype).to_wire()
            )
        if isinstance(m, Open):
            await self.admit(caller, 0)
            return Opened(self._open(caller, m)).to_wire()
        if isinstance(m, Result | Failure):
            if self.deliver is None:
                raise WireError("stage: this node is waiting for no results")
            self.deliver(caller, m)
            return {}
        key = (caller, m.sid)
        if isinstance(m, Close | Reveal) and (s := self.sessions.get(key)) is not None:
            with contextlib.suppress(Refusal):  # a check's last rows still on their way
                await self._quiet(s, CLOSE_WAIT_S)
        if isinstance(m, Close):
            s = self.sessions.get(key)
            steps = self.ledgers.close(key)
            self._end([key], m.keep if self.prefix else b"")
            return Closed(tuple(s.tally.experts.items()) if s is not None else (), steps).to_wire()
        if isinstance(m, Reveal):
            return Revealed(self.ledgers.show(key, m.first, m.last)).to_wire()
        return Pong(self._session(key).at).to_wire()

    def _record(
        self, key: tuple[str, str], m: Step, out: np.ndarray | tuple[TokenEvent, ...]
    ) -> np.ndarray:
        """Write a computed step into its session's ledger, as received (`m`, its rows not
        yet widened) and as it is sent: the output rows in the wire's type (returned, to be
        sent as they are recorded), or the head's tokens."""
        if isinstance(out, tuple):
            sent, dt = np.array([t.token for t in out], np.int32), "i32"
        else:
            sent, dt = np.ascontiguousarray(out, DTYPES[self.wire_dtype]), self.wire_dtype
        self.ledgers.record(key, Shown(m.start, m.x, m.dt, sent, dt, m.singly, m.verify))
        return sent

    def inline(self, m: StageMessage) -> bool:
        """Whether a one-way message may be handled in its stream's reader task: a
        forwarded decode step on a node that dispatches no experts, while nothing else
        computes here, so that it computes in place (holding the event loop anyway) and
        hands its output on; a result for this node. Saves a task start and a pass through
        the scheduler per hop (the ring's queue per hop about halves: bench/bench_swarm.py
        prints it)."""
        if isinstance(m, Result | Failure):
            return True
        if not isinstance(m, Step) or m.forward is None:
            return False
        served = self.served()
        if served is None or served.dispatches or len(m.x) > INLINE_TOKENS:
            return False
        if self.batcher.company():
            return False  # in a task of its own, the steps behind it in the stream join its batch
        with held_now([served.backend]) as free:  # else the reader would wait for a thread
            return free

    def admitted(self, peer: str) -> bool:
        """Whether `peer` has a session here, as its owner or the hop before it: the transport
        lets it send frames of any size (channel.Intake); anyone else only small ones."""
        return any(k[0] == peer or s.prev == peer for k, s in self.sessions.items())

    def _session(self, key: tuple[str, str]) -> ServedSession:
        s = self.sessions.get(key)
        if s is None:
            raise Refusal("gone", "no such session (expired, or this node restarted)")
        return s

    async def _forwarded(self, caller: str, m: Step, f: Forward) -> None:
        """A step of a forwarded chain: compute, then pass the output on (or back home)."""
        owner = f.owner if f.owner is not None else caller
        ticket = f.ticket if m.part is None else f"{f.ticket}/{m.part[0]}"
        if not self._first_copy(owner, m.sid, ticket):
            return  # the same step by the other path (channel.Channels.twin): computed once
        blame = [self.me]
        """The peer a failure is pinned on: this node, the next hop while sending to it, or
        the hop before when it sent rows that are not finite."""
        try:
            if m.open is not None and (owner, m.sid) not in self.sessions:
                await self._open_with_step(caller, owner, m)
            s = self._session((owner, m.sid))
            if caller not in (owner, s.prev):
                raise Refusal(
                    "bad", "only the session's owner and the hop before it on the route may step it"
                )
            received, m = m, m.widened()
            if m.dt != "i32" and not np.isfinite(m.x).all():
                blame[0] = caller
                raise self._unusable_input(s, m, caller)
            if m.part is not None:
                await self._part(s, owner, received, m, f, blame)
                return
            streams = (
                m.verify
                and m.singly
                and len(m.x) > 1
                and s.sampler is None
                and bool(f.next_hops)
                and not f.opens
            )
            emit = self._emitter(s, owner, m, f, blame) if streams else None
            out = await self._step(s, m, emit)
            sent = self._record((owner, m.sid), received, out)
            trace = _traced(f, s)
            if not isinstance(out, tuple):
                if not f.next_hops:
                    raise Refusal("bad", "the route ends before the head")
                if emit is None:
                    blame[0], sid = f.next_hops[0]
                    await self.send(
                        blame[0],
                        Step(
                            sid,
                            m.start,
                            sent,
                            self.wire_dtype,
                            m.ids,
                            Forward(f.ticket, f.next_hops[1:], owner, trace, opens=f.opens[1:]),
                            m.singly,
                            m.verify,
                            f.opens[0] if f.opens else None,
                        ).to_wire(),
                    )
            else:
                if f.next_hops:
                    raise Refusal(
                        "bad", "the route goes on after the head: the head hop must be the last"
                    )
                blame[0] = owner
                await self.send(owner, Result(f.ticket, out, trace).to_wire())
            self.forwarded += 1
        except KvasirError as exc:  # Refusal, HopFailed (forwarding), WireError
            await self._report(owner, f.ticket, exc, blame[0])

    async def _report(self, owner: str, ticket: str, exc: KvasirError, culprit: str) -> None:
        """Tell a forwarded step's owner that it failed, and whom to blame."""
        failure = Failure(ticket, *_why(exc), culprit)
        if culprit == owner:
            log.debug("result not delivered", owner=owner, reason=failure.error[:200])
            return
        with contextlib.suppress(HopFailed):
            await self.send(owner, failure.to_wire())

    def _emitter(
        self, s: ServedSession, owner: str, m: Step, f: Forward, blame: list[str]
    ) -> Callable[[int, int, np.ndarray], Awaitable[np.ndarray]]:
        """Sends each row of a speculative step computed singly to the next hop as soon as
        it is computed (Step.part; returns the row as sent)."""
        peer, sid = f.next_hops[0]
        on = Forward(f.ticket, f.next_hops[1:], owner)

        async def emit(j: int, n: int, row: np.ndarray) -> np.ndarray:
            self._check_finite(s, replace(m, start=m.start + j, x=row), row)
            sent = np.ascontiguousarray(row, DTYPES[self.wire_dtype])
            blame[0] = peer
            step = Step(sid, m.start, sent, self.wire_dtype, m.ids, on, True, True, part=(j, n))
            await self.send(peer, step.to_wire())
            blame[0] = self.me
            return sent

        return emit

    async def _part(
        self, s: ServedSession, owner: str, received: Step, m: Step, f: Forward, blame: list[str]
    ) -> None:
        """Row j of n of a speculative step that comes a row at a time (Parts): computed in
        its turn and sent on at once, or at the head drawn after."""
        assert m.part is not None
        j, n = m.part
        p = await self._turn(s, f.ticket, m.start, j, n)
        if p is None:
            return  # a row before it failed here, and the owner was told
        head = s.sampler is not None
        self.rows_apart += 1
        try:
            if (m.start, n) != (p.start, p.n):
                raise WireError("stage.part: a row's start and rows must be its check's")
            if head and m.ids is None:
                raise WireError("stage.ids: the head needs the token ids of the positions sent")
            if j == 0:
                await self._begin(s, m, n)
            else:
                await self.admit(s.tally.owner, s.layers)  # metered before it computes
            if not p.answered:
                row = await self._part_row(s, p, m, j)
                if head:
                    assert m.ids is not None
                    p.drawn.append(_draw(s, row[-1], s.history[: s.at]))
                    if j + 1 == n or p.drawn[-1].token != m.ids[j + 1]:
                        p.answered, blame[0] = True, owner
                        tokens = tuple(p.drawn)
                        await self.send(owner, Result(f.ticket, tokens).to_wire())
                        blame[0] = self.me
                else:
                    if not f.next_hops:
                        raise Refusal("bad", "the route ends before the head")
                    p.sent.append(await self._emitter(s, owner, m, f, blame)(j, n, row))
        except BaseException:
            p.failed = True
            raise
        finally:
            p.received.append(received.x)
            p.complete = p.failed or len(p.received) == n
            _moved(s)
        if len(p.received) == n:
            sent = (
                np.array([t.token for t in p.drawn], np.int32) if head else np.concatenate(p.sent)
            )
            shown = Shown(
                p.start,
                np.concatenate(p.received),
                received.dt,
                sent,
                "i32" if head else self.wire_dtype,
                True,
                True,
            )
            self.ledgers.record((owner, m.sid), shown)
            self.forwarded += 1

    async def _turn(
        self, s: ServedSession, ticket: str, start: int, j: int, n: int
    ) -> Parts | None:
        """Wait for row j's turn: the rows before it taken, or (the first) the step before
        it ended. None: a row before it failed here."""
        with trio.move_on_after(PART_WAIT_S):
            while True:
                p = s.parts
                if p is not None and p.ticket == ticket:
                    if p.failed:
                        return None
                    if len(p.received) == j:
                        return p
                elif j == 0 and (p is None or p.complete):
                    s.parts = Parts(ticket, start, n)
                    return s.parts
                await s.moved.wait()
        raise Refusal(
            "bad",
            f"row {j} of a speculative step came, but not the rows before it, within "
            f"{PART_WAIT_S:g} s",
        )

    async def _quiet(self, s: ServedSession, wait_s: float = PART_WAIT_S) -> None:
        """Wait until the speculative step coming a row at a time (if any) has all come."""
        with trio.move_on_after(wait_s):
            while s.parts is not None and not s.parts.complete:
                await s.moved.wait()
            return
        if s.parts is not None:  # its missing rows will not be waited for again
            s.parts.failed = s.parts.complete = True
        raise Refusal(
            "bad", f"the step before it, sent a row at a time, did not end within {wait_s:g} s"
        )

    def _first_copy(self, owner: str, sid: str, ticket: str) -> bool:
        """Whether this forwarded step is new here (a far peer sends small ones twice)."""
        key = (owner, sid, ticket)
        if key in self._tickets:
            self.twins += 1
            return False
        self._tickets[key] = None
        if len(self._tickets) > KEEP_TICKETS:
            self._tickets.popitem(last=False)
        return True

    async def _open_with_step(self, caller: str, owner: str, m: Step) -> None:
        """Open the session a forwarded step opens with (Step.open), in its owner's name:
        only with the owner's delegation to this node, and only from the hop its Open
        names as the one before (or the owner), so no peer opens sessions here in another
        gateway's name (and on its account) without that gateway's word."""
        assert m.open is not None
        if m.open.sid != m.sid or caller not in (owner, m.open.prev):
            raise Refusal(
                "bad", "a session opening with a step must be that step's, from its owner"
            )
        if self.delegations is None:
            raise Refusal("bad", "this node opens no session with a step: open it first")
        try:
            if self.delegations.check(m.open.delegation, self.me).gateway != owner:
                raise Refusal(
                    "bad", "the delegation of a session opening with a step is not its owner's"
                )
        except WireError as exc:
            raise Refusal("bad", f"the session's delegation does not hold: {exc}") from None
        await self.admit(owner, 0)
        self._open(owner, m.open)

    def _open(self, caller: str, m: Open) -> int:
        """Open the session; the positions it starts with (a kept prefix of its prompt)."""
        served = self.served()
        if m.model != self.model_id():
            raise Refusal("bad", "this node serves no stage of that model")
        if served is None:  # a node that just (re)started: a passing state, not a fault
            raise Refusal("busy", "this node is still loading the model: retry shortly")
        if m.end > served.hp.n_layer:
            raise Refusal(
                "bad", f"layers [{m.first}, {m.end}) reach past the model's {served.hp.n_layer}"
            )
        chain = served.stages_for(m.first, m.end, m.embed, m.head)
        self.expire()
        key = (caller, m.sid)
        if len(self.sessions) >= self.max_sessions and key not in self.sessions:
            raise Refusal("busy", f"serving {len(self.sessions)} sessions, the limit")
        need = -(-m.max_tokens // PAGE) * PAGE
        for stage in chain:
            if stage.kv.max_session_tokens < m.max_tokens or stage.kv.free_tokens < need:
                raise Refusal(
                    "busy",
                    f"KV cache has {stage.kv.free_tokens} free slots, the session needs {need}",
                )
            if stage.kv.recurrent and not stage.kv.free_states:
                raise Refusal(
                    "busy",
                    f"all {stage.kv.spec.state_slots} recurrent-state slots "
                    "of this stage's delta-net layers are in use",
                )
        sampler = None
        if m.head and not m.embeddings:
            constraint = None
            if m.sampling.grammar:
                try:
                    constraint = Constraint(vocabulary(served.tokenizer()), m.sampling.grammar)
                except GrammarError as exc:
                    raise Refusal("bad", str(exc)) from None
            sampler = Sampler(m.sampling, constraint, m.prompt)
            if m.sampling.temperature > 0:  # a replay continues the seeded stream where it was
                sampler.skip(m.draws)
        self._end([key])
        self.ledgers.begin(key)
        s = self.sessions[key] = ServedSession(
            chain,
            [st.open_session() for st in chain],
            sampler,
            m.logprobs,
            m.max_tokens,
            m.prev,
            tally=Tally(caller, m.delegation),
            scopes=[(caller, st.window, st.embed, st.head) for st in chain],
            used=self.clock(),
            out="embd" if m.embeddings else "last",
        )
        return s.attach(m.prefix) if self.prefix and m.prefix else 0

    async def _step(
        self,
        s: ServedSession,
        m: Step,
        emit: Callable[[int, int, np.ndarray], Awaitable[np.ndarray]] | None = None,
    ) -> np.ndarray | tuple[TokenEvent, ...]:
        """The hop's output rows, or at the head the tokens drawn (one; a speculative
        step's accepted guesses and the head's own token after them). `emit`: a step
        computed singly hands each row to it as soon as it is computed (_emitter)."""
        await self._quiet(s)
        await self._begin(s, m, len(m.x))
        x = m.x
        if emit is not None:  # its rows reach the next hops before it ends here
            s.parts = Parts("", m.start, len(x))
        try:
            with self._computing(s):
                if m.start < s.at and s.recurrent:
                    await self._go_back(s, m.start)
                if m.verify and s.sampler is not None:
                    return await self._verify(s, m)
                if m.singly or m.verify and s.recurrent:  # as the decode steps they were
                    outs = []
                    for i in range(len(x)):
                        outs.append(await self._row(s, x, m.start, i))
                        if emit is not None:
                            await emit(i, len(x), outs[-1])
                    out = outs[-1] if s.sampler is not None else np.concatenate(outs)
                elif s.out == "last" and self.batcher.takes(s.chain, m.start, len(x)):
                    out = await self.batcher.step(s, x, m.start, self._solo)
                else:
                    out = await _run_chain(s, x, m.start, self.company)
        finally:
            if emit is not None and s.parts is not None:
                s.parts.complete = True
                _moved(s)
        self._check_finite(s, m, out)
        self.tokens += len(x)
        s.at = m.start + len(x)
        if s.sampler is None:
            return out
        return (_draw(s, out[-1], s.history),)

    @contextlib.contextmanager
    def _computing(self, s: ServedSession) -> Iterator[None]:
        """The block computes for `s`: the engine's errors become refusals, and the
        session's last use and its compute's times (experts' waits too) are stamped."""
        began = time.monotonic()
        try:
            with collecting_waits() as waited:
                yield
        except (KVCacheFull, NoWorkers) as exc:
            raise Refusal("busy", str(exc)) from None
        except ComputeError as exc:
            raise Refusal("bad", str(exc)) from None
        finally:
            s.used = self.clock()
            s.last_step = (began, time.monotonic(), waited[0])

    async def _begin(self, s: ServedSession, m: Step, rows: int) -> None:
        """Check a step of `rows` positions against the session, meter it, and take its
        token ids into the head's history: what comes before its compute."""
        x, first = m.x, s.chain[0]
        if first.embed != (m.dt == "i32") or not first.embed and x.shape[1] != first.hp.n_embd:
            raise WireError(
                "stage.x: expected "
                + ("token ids (i32 [T])" if first.embed else f"hidden rows [T, {first.hp.n_embd}]")
            )
        if m.start + rows > s.max_tokens:
            raise Refusal(
                "bad", f"positions up to {m.start + rows} exceed the session's {s.max_tokens}"
            )
        if s.sampler is not None and m.ids is None:
            raise WireError("stage.ids: the head needs the token ids of the positions sent")
        await self.admit(s.tally.owner, len(x) * s.layers)  # metered before it computes
        if s.sampler is not None:
            assert m.ids is not None
            del s.history[m.start :]
            s.history += m.ids
        s.used = self.clock()
        if m.start >= s.at:  # on from the last step: no guess of it to go back past
            for kv in s.sessions:
                kv.drop_rewinds()

    async def _part_row(self, s: ServedSession, p: Parts, m: Step, j: int) -> np.ndarray:
        """Row j of a step that comes a row at a time (Parts), computed as _row computes it
        (a delta-net's state is kept after each row but the last)."""
        with self._computing(s):
            if j == 0 and m.start < s.at and s.recurrent:
                await self._go_back(s, m.start)
            p.rows.append(m.x)
            out = await self._row(s, np.concatenate(p.rows), p.start, j, p.n)
        self._check_finite(s, replace(m, start=p.start + j), out)
        self.tokens += 1
        s.at = p.start + j + 1
        return out

    async def _verify(self, s: ServedSession, m: Step) -> tuple[TokenEvent, ...]:
        """A speculative step at the head (Step.verify): a token drawn after each position,
        until a draw differs from the next guess. Computed singly, each position alone and
        those after the first miss not at all; else all as one batch (logits of every
        row). The next step starts from the last token drawn."""
        assert m.ids is not None
        drawn: list[TokenEvent] = []
        if not m.singly and not s.recurrent:
            s.out = "all"
            try:
                logits = await _run_chain(s, m.x, m.start, self.company)
            finally:
                s.out = "last"
            self._check_finite(s, m, logits)
            self.tokens += len(m.x)
            s.at = m.start + len(m.x)
            for i, row in enumerate(logits):
                drawn.append(_draw(s, row, s.history[: m.start + i + 1]))
                if i + 1 == len(m.x) or drawn[-1].token != m.ids[i + 1]:
                    break
            return tuple(drawn)
        for i in range(len(m.x)):
            out = await self._row(s, m.x, m.start, i)
            self._check_finite(s, m, out)
            self.tokens += 1
            s.at = m.start + i + 1
            drawn.append(_draw(s, out[-1], s.history[: s.at]))
            if i + 1 == len(m.x) or drawn[-1].token != m.ids[i + 1]:
                return tuple(drawn)
        raise AssertionError("unreachable: the last position returns")

    async def _row(
        self, s: ServedSession, x: np.ndarray, start: int, i: int, n: int = 0
    ) -> np.ndarray:
        """Position start + i of a step of `n` positions (all of `x`'s when 0) computed one
        position at a time. A delta-net's state cannot go back, so where the chain holds
        one, its state after each position but the last is copied: the next step may start
        after any guess of this one (the head rejected the guess after it), as it would at
        an attention layer's KV."""
        out = await _run_chain(s, x[i : i + 1], start + i, self.company)
        if s.recurrent and i + 1 < (n or len(x)):
            s.guessed = (start, x)
            for kv in s.sessions:
                kv.keep_rewind()
        return out

    async def _go_back(self, s: ServedSession, target: int) -> None:
        """Where a stage kept no copy of its state at `target` (none was free), go back to
        the nearest copy before it that every stage kept and replay the last speculative
        step's rows from there, one at a time as they were computed: the same state, for
        the compute of those rows. Without such a copy the step is refused (reserve)."""
        states = [kv for kv, st in zip(s.sessions, s.chain, strict=True) if st.kv.recurrent]
        if s.guessed is None or all(target in kv.rewinds for kv in states):
            return
        first, rows = s.guessed
        kept = [
            p
            for p in range(min(target, first + len(rows) - 1), first, -1)
            if all(p in kv.rewinds for kv in states)
        ]
        if not kept:
            return
        for i in range(kept[0] - first, target - first):
            await _run_chain(s, rows[i : i + 1], first + i, self.company)
        self.replayed += target - kept[0]

    async def _solo(self, s: ServedSession, x: np.ndarray, start: int) -> np.ndarray:
        return await _run_chain(s, x, start, self.company)

    def _check_finite(self, s: ServedSession, m: Step, out: np.ndarray) -> None:
        """Refuse a step whose output is not finite: this node's fault (a corrupt slice
        computes NaN), said before the output reaches the next hop, which would refuse it
        and be blamed in our place. The check is one pass over the rows (or the logits),
        a few thousandths of a decode step's compute."""
        if np.isfinite(out).all():
            return
        what = "logits" if s.sampler is not None else "hidden states"
        layers, positions = _where(s, m)
        log.warning(
            "computed non-finite output: refusing to send it (are the model's slices corrupt?)",
            what=what,
            layers=layers,
            positions=positions,
        )
        raise Refusal(
            "broken",
            f"this node computed NaN or infinite {what} at {layers}, "
            f"positions {positions}: its weights may be corrupt; route "
            "around it",
        )

    def _unusable_input(self, s: ServedSession, m: Step, sender: str) -> Refusal:
        """The refusal of forwarded rows that are not finite, which blames their sender: a
        peer that does not check its own output (a faulty build, or a hostile peer) would
        otherwise have this node taken for the broken one."""
        layers, positions = _where(s, m)
        log.warning(
            "received non-finite hidden states: refusing them and naming the sender",
            sender=sender,
            layers=layers,
            positions=positions,
        )
        return Refusal(
            "broken",
            f"sent NaN or infinite hidden states for {layers}, positions "
            f"{positions}: its weights may be corrupt; route around it",
        )

    def expire(self) -> None:
        now = self.clock()
        self._end([k for k, s in self.sessions.items() if now - s.used > self.idle_s])

    def close_all(self) -> None:
        self._end(list(self.sessions))

    def _end(self, keys: list[tuple[str, str]], keep: bytes = b"") -> None:
        """Close sessions; `keep` (one session's page keys) keeps its prefix for reuse."""
        for key in keys:
            if (s := self.sessions.pop(key, None)) is not None:
                s.close(keep)
                self.ledgers.close(key)
        self._ended.set()
        self._ended = trio.Event()

    async def wait_unused(self, stages: list[Stage]) -> None:
        """Return once no session runs on any of `stages` (they close or expire)."""
        while any(st in stages for s in self.sessions.values() for st in s.chain):
            await self._ended.wait()


async def _run_chain(s: ServedSession, x: np.ndarray, start: int, company: Company) -> np.ndarray:
    """A step through the hop's stages: in place when short and nothing else computes on
    them, else in a worker thread. A short step on a stage that dispatches experts runs as
    steps (compute.steps) on the event loop, awaiting the remote experts of each MoE layer
    while holding only the stages' own locks (reentrant: the loop thread's), so the decode
    steps of concurrent sessions interleave: one computes while others wait for their
    experts, and their rows reach the workers together (one message per worker and layer,
    ExpertDispatcher.remote). While a prefill in a worker thread holds a stage, decode
    steps wait for it on the loop."""
    short = len(x) <= INLINE_TOKENS
    remote = [st.choose_experts(len(x)) for st in s.chain]  # offered layers sent out
    if not any(st.dispatches or out for st, out in zip(s.chain, remote, strict=True)):
        return await run_short(s.chain, short, _run_chain_now, s, x, start)
    tally = TALLY.set(s.tally)
    try:
        if not short:  # the thread and its expert calls run in this context
            return await trio.to_thread.run_sync(_run_chain_now, s, x, start, remote)
        return await _run_chain_steps(s, x, start, company, remote)
    finally:
        TALLY.reset(tally)


async def _run_chain_steps(
    s: ServedSession, x: np.ndarray, start: int, company: Company, remote: list[frozenset[int]]
) -> np.ndarray:
    """A short step as steps on the event loop (see _run_chain)."""
    delay = STAGE_POLL_S[0]
    with contextlib.ExitStack() as waiting:
        while True:
            with locks_now(st.own_lock for st in s.chain) as held:
                if held and not any(st.queued for st in s.chain):
                    waiting.close()  # a prefill that stepped aside for us may take it back
                    company.now += 1
                    token = COMPANY.set(company)
                    try:
                        for stage, session, out in zip(s.chain, s.sessions, remote, strict=True):
                            x = await drive_async(
                                stage.forward_steps(session, x, start, s.out, out),
                                functools.partial(_serve_async, stage),
                            )
                    finally:
                        company.now -= 1
                        COMPANY.reset(token)
                    return x
            # A forward in a worker thread (a prefill) holds a stage or waits for it: wait
            # for it here rather than in a thread of our own, which would hold the stage in
            # turn through its remote waits and send every later step to a thread the same
            # way (a convoy: with 16 sessions no step ran on the loop any more, and none
            # overlapped); and start no step meanwhile, or steps in flight could hold it for
            # ever. Counted as waiting, so that a prefill steps aside between its pieces.
            if delay == STAGE_POLL_S[0]:
                for st in s.chain:
                    waiting.enter_context(st.waiting_on_loop())
            await trio.sleep(delay)
            delay = min(2 * delay, STAGE_POLL_S[1])


def _run_chain_now(
    s: ServedSession, x: np.ndarray, start: int, remote: list[frozenset[int]] | None = None
) -> np.ndarray:
    """The chain's stages one after another; `remote`: each one's offered layers sent out."""
    for i, (stage, session) in enumerate(zip(s.chain, s.sessions, strict=True)):
        x = stage.forward(session, x, start, s.out, remote[i] if remote else frozenset())
    return x


async def _serve_async(stage: Stage, need: tuple[Any, ...]) -> Any:
    """A need of a forward run on the event loop: a graph in place (in a thread if another
    computation holds the backend), expert outputs from each shard (remote ones awaited);
    nothing between the pieces of a run."""
    if need[0] == "pause":
        return None
    if need[0] == "run":
        return await run_short([stage.backend], True, need[1].run, need[2])
    _, layer, cur, ids = need

    async def shard_outputs(ask: tuple[ExpertShard, np.ndarray, np.ndarray]) -> np.ndarray:
        shard, rows, sel = ask
        if shard.acall is not None:
            with waiting():
                return await shard.acall(layer, rows, sel)
        holders = [shard.call] if isinstance(shard.call, ExpertWorker) else []
        return await run_short(holders, True, shard.call, layer, rows, sel)

    return await drive_async(dispatch_steps(layer, cur, ids, stage.shards_of(layer)), shard_outputs)


def _draw(s: ServedSession, logits: np.ndarray, history: list[int]) -> TokenEvent:
    """The head's token after `history` from one position's logits (with its logprobs,
    when the session asked for them)."""
    assert s.sampler is not None
    token = s.sampler(logits, history)
    if not s.logprobs:
        return TokenEvent(token)
    lp = log_softmax(logits)
    top = np.argsort(-lp, kind="stable")[: s.logprobs]
    return TokenEvent(token, float(lp[token]), tuple((int(i), float(lp[i])) for i in top))


def _moved(s: ServedSession) -> None:
    """Wake the rows and steps of `s` waiting for their turn (StageServer._turn, _quiet)."""
    s.moved.set()
    s.moved = trio.Event()


def _where(s: ServedSession, m: Step) -> tuple[str, str]:
    """The layers and positions of a step, as a refusal names them."""
    return (
        f"layers [{s.chain[0].window[0]}, {s.chain[-1].window[1]})",
        f"{m.start}..{m.start + len(m.x) - 1}",
    )


def _why(exc: KvasirError) -> tuple[Code, str]:
    """The code and reason a forwarded chain's failure reports: a refusal's own, or the
    next hop's (it could not be reached, or broke off)."""
    if isinstance(exc, Refusal):
        return exc.code, exc.detail
    if isinstance(exc, Unreachable):
        return "unreachable", exc.reason
    if isinstance(exc, HopFailed):
        return "gone", exc.reason
    return "bad", str(exc)


def _traced(f: Forward, s: ServedSession) -> tuple[tuple[float, ...], ...] | None:
    """A traced step's stamps so far plus this hop's, as its output is handed on:
    (received, compute began, compute ended, handed on, experts waited); None when the
    step is not traced.

    `rx` is stamped by `channel.serve` when the frame was read (a step from this node
    itself has none: it was received when it was handed over)."""
    if f.trace is None:
        return None
    began, ended, experts = s.last_step
    return (
        *f.trace,
        (f.rx if f.rx is not None else began, began, ended, time.monotonic(), experts),
    )
