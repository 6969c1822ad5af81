"""SwarmGenerator: the Generator that runs a request along a route of peers.

    plan route (routing.plan_route over online holders, our latencies, fit peers only)
      ─▶ open a session on every hop ─▶ prefill the prompt ─▶ decode token by token
      each step: gateway ─x─▶ hop 1 ─h─▶ hop 2 ─h─▶ … ─▶ last hop samples ─token─▶ gateway

Boundaries go stage to stage: the gateway sends a step to the first hop with the rest
of the route (`next`) and a ticket; each hop computes, sends its hidden rows straight
to the next one, and the last (the head) returns only the sampled token (and logprobs)
to the gateway's Inbox, all as one-way messages (serving.py). On the 3-stage ring of the
bundled model (gateway on the first stage, holding the head) a token costs 3 one-way
messages where relaying every boundary through the gateway cost 4, and between
machines one network latency less per token: a chain of n remote hops pays n+1 link
latencies, not 2n. A hop on this node itself is a direct call (no serialization, no
network), and it forwards like any other.

What relaying gave for free is kept by other means:
- which hop failed: a hop that cannot reach the next one reports it by name (the gateway
  checks the accusation with a ping of its own); a chain that goes silent is probed by
  the gateway (`ping` answers with the positions a session has computed), and the first
  hop that does not answer, or has not reached the step, is the one replaced. Checking
  progress after PROBE_AFTER_S (doubling) finds a SIGKILLed stage in about a second
  instead of at the step timeout.
- per-hop latency (what routing minimises, measured rather than reported): every
  RELAY_EVERY-th decode step (and every step of a one-hop route) is relayed hop by hop,
  each timed by the gateway. Every TRACE_EVERY-th forwarded step also collects each hop's
  own stamps (steptrace), which split the step's time into queue, compute and the wire.

While the consumer handles a token (the HTTP stream), the next step already runs
(`_Pending`): the consumer's time is off the token's critical path.

Accounting (what settlement pays by): every step a route computes counts, for each hop,
the positions it sent times the hop's layers (the head counting as one layer); the
stages' close replies add the expert rows they had computed elsewhere for the session
(capped by what their layers could have dispatched). Hops replaced by failover keep what
they did; a failed step counts for no one. `work(request_id)` hands the totals to the
gateway once the generation has ended.

Failover: when a hop fails, times out or refuses, its peer is marked unfit for
`unfit_s`, sessions on the old route are closed, a new route is planned, and the
token history (prompt + tokens already emitted) is replayed there as a prefill. The
new route's head continues the seeded sampling stream where the old one stopped, so
greedy and seeded generations continue with the same tokens.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from kvasird.config import InferenceConfig
from kvasird.inference.api import (
    Busy,
    Finished,
    GenerationError,
    GenerationRequest,
    HopWork,
    ModelInfo,
    NoRoute,
    TokenEvent,
    UnknownModel,
)
from kvasird.inference.client.failover import judge
from kvasird.inference.client.routing import (
    Fitness,
    Hop,
    Latency,
    PeerHoldings,
    Route,
    plan_route,
    uncovered,
)
from kvasird.inference.errors import HopFailed, Refused, Unreachable
from kvasird.inference.protocol import STAGE_PROTOCOL, tensors
from kvasird.inference.steptrace import TRACE_EVERY, StepTrace, Traces
from kvasird.inference.transport.channel import Channels
from kvasird.logs import get_logger

RELAY_EVERY = 32
"""One decode step in this many is relayed hop by hop, so the gateway times each peer."""
PROBE_AFTER_S = 0.5
"""A forwarded step without a result this long (or twice the route's last step time, if
longer) gets its hops probed, then again after twice as long each time."""
PROBE_TIMEOUT_S = 1.0
"""A probed hop must answer its ping this fast (or in three times the route's last step
time, if longer: a hop computing a step in place answers once it is done)."""
PREFILL_CHUNK = 256
"""Tokens per prefill message: bounds one frame (256 × n_embd × 4 B)."""
MAX_EXPERTS_PER_ROW = 64
"""Most experts one row selects in any layer: caps the expert units a stage may report."""
KEEP_WORK = 1024
"""Finished generations whose work is kept until the gateway asks for it."""
REPLAN_EVERY_S = 0.25
"""How often a failed-over generation without a route looks at the coverage map again."""
log = get_logger("kvasird.inference.client.swarm")

LocalHandler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class Inbox:
    """Results of forwarded steps, by ticket, for the generations waiting on them.

    A result is taken only from a peer on the waiting route (or this node); anything else
    (a late result of a step given up on, a stranger) is dropped.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[frozenset[str], trio.MemorySendChannel[Any]]] = {}
        self.dropped = 0

    @contextlib.contextmanager
    def expect(self, ticket: str, peers: Iterable[str]
               ) -> Iterator[trio.MemoryReceiveChannel[dict[str, Any]]]:
        send, recv = trio.open_memory_channel[dict[str, Any]](1)
        self._waiting[ticket] = (frozenset(peers), send)
        try:
            yield recv
        finally:
            self._waiting.pop(ticket, None)

    def deliver(self, sender: str, msg: dict[str, Any]) -> None:
        waiting = self._waiting.get(msg.get("ticket")) if isinstance(msg.get("ticket"), str) \
            else None
        if waiting is None or sender not in waiting[0]:
            self.dropped += 1
            return
        with contextlib.suppress(trio.WouldBlock):
            waiting[1].send_nowait({**msg, "from": sender, "at": time.monotonic()})


@dataclass
class Progress:
    """A generation in flight, as the admin API shows it."""

    route: tuple[str, ...] = ()
    """Peers of the current route."""
    tokens: int = 0
    """Tokens emitted so far."""
    failovers: int = 0
    """Routes rebuilt so far."""
    hop_ms: dict[str, float] = field(default_factory=dict)
    """Last relayed step time per hop peer (ms), the local one included."""
    step_ms: float = 0.0
    """Last step time along the whole route (ms)."""


class SwarmGenerator:
    """Generates across the peers that hold the model, from this node's coverage map."""

    def __init__(self, me: str, info: Callable[[], ModelInfo | None], n_layer: Callable[[], int],
                 holders: Callable[[], list[PeerHoldings]], channels: Channels,
                 local: LocalHandler, latency: Latency, fitness: Fitness,
                 config: InferenceConfig, inbox: Inbox) -> None:
        self.me, self.info, self.n_layer, self.holders = me, info, n_layer, holders
        self.channels, self.local, self.inbox = channels, local, inbox
        self.latency, self.fitness, self.config = latency, fitness, config
        self.active: dict[str, Progress] = {}
        self.traces = Traces()
        """Where the traced steps' time went (steptrace)."""
        self._work: dict[str, tuple[HopWork, ...]] = {}
        self.nursery: trio.Nursery | None = None
        """Where steps run ahead of the consumer (set by the service once it runs)."""

    def models(self) -> list[ModelInfo]:
        info = self.info()
        return [info] if info is not None else []

    def work(self, request_id: str) -> tuple[HopWork, ...]:
        return self._work.pop(request_id, ())

    def resolve(self, name: str) -> ModelInfo:
        info = self.info()
        if info is not None and (name in ("", info.model_id, info.label) or (
                len(name) >= 8 and info.model_id.startswith(name.lower()))):
            return info
        known = f"{info.model_id} ({info.label})" if info else "none (set [market] model)"
        raise UnknownModel(f"model {name!r} is not known here; this node routes {known}")

    def _fit(self) -> list[PeerHoldings]:
        return [h for h in self.holders() if self.fitness.fit(h.peer)]

    def plan(self) -> Route:
        route = plan_route(self.n_layer(), self._fit(), self.latency)
        if route is None:
            raise NoRoute(f"the online peers do not cover the model ({self.missing()}): see "
                          "`kvasird coverage`, and retry when the market has filled the gaps")
        return route

    def missing(self) -> str:
        """What keeps the fit holders from forming a route, in words."""
        gaps = ", ".join(uncovered(self.n_layer(), self._fit()))
        out = f"nobody fit serves {gaps}" if gaps else "their windows do not chain"
        if unfit := self.fitness.snapshot():
            out += f"; {len(unfit)} peer(s) avoided after failing lately"
        return out

    async def replan(self) -> Route:
        """A route for a generation whose route just failed: the coverage map may lack its
        replacement for a moment (a replica's record late or expired, a replica still
        loading), so wait up to the step timeout for one."""
        give_up = trio.current_time() + self.config.step_timeout_s
        waited = False
        while True:
            try:
                return self.plan()
            except NoRoute as exc:
                if trio.current_time() >= give_up:
                    raise
                if not waited:
                    log.warning("no route to fail over to yet: waiting for coverage",
                                why=str(exc), holders=len(self.holders()))
                    waited = True
                await trio.sleep(REPLAN_EVERY_S)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | Finished]:
        info = self.resolve(request.model)
        s = request.sampling
        n_prompt = len(request.prompt)
        budget = min(s.max_tokens, info.context_length - n_prompt)
        if n_prompt == 0 or budget < 1:
            raise Busy(f"the prompt of {n_prompt} tokens leaves no room in the context of "
                       f"{info.context_length}: shorten it")
        rid = request.request_id or secrets.token_hex(8)
        progress = self.active[rid] = Progress()
        seed = s.seed if s.seed is not None else secrets.randbits(62)
        sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                    "repetition_penalty": s.repetition_penalty, "seed": seed}
        run = _Run(self, info.model_id, n_prompt + budget, sampling, s.logprobs, progress)
        history, produced, reason = list(request.prompt), 0, "length"
        pending: _Pending | None = None
        try:
            reply = await run.begin(history)
            while True:
                token = int(reply["token"])
                if token in request.stop_tokens:
                    reason = "stop"
                    break
                top = tuple((int(t), float(lp)) for t, lp in reply.get("top", ()))
                event = TokenEvent(token, reply.get("logprob"), top)
                produced += 1
                history.append(token)
                more = produced < budget
                if more:  # the next step runs while the consumer handles this token
                    pending = _Pending.start(self.nursery, run.step, history,
                                             len(history) - 1, produced)
                yield event
                progress.tokens = produced
                if not more:
                    break
                assert pending is not None
                reply = await pending.result()
                pending = None
            yield Finished(reason, n_prompt, produced)
        finally:
            self.active.pop(rid, None)
            with trio.CancelScope(shield=True):
                if pending is not None:
                    with trio.move_on_after(2):
                        await pending.cancel()
                with trio.move_on_after(2):
                    await run.close()
                if len(self._work) >= KEEP_WORK:  # never asked for: drop the oldest
                    del self._work[next(iter(self._work))]
                self._work[rid] = run.work()


class _Pending:
    """A step running ahead in the service's nursery while the caller yields a token.

    Without a nursery (a generator used outside the daemon) the step runs when awaited.
    """

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.value: dict[str, Any] | None = None
        self.error: Exception | None = None
        self.call: Callable[[], Awaitable[dict[str, Any]]] | None = None

    @classmethod
    def start(cls, nursery: trio.Nursery | None,
              fn: Callable[..., Awaitable[dict[str, Any]]], *args: Any) -> _Pending:
        p = cls()
        if nursery is None:
            p.call = lambda: fn(*args)
        else:
            nursery.start_soon(p._run, fn, args)
        return p

    async def _run(self, fn: Callable[..., Awaitable[dict[str, Any]]], args: tuple) -> None:
        try:
            with self.scope:
                # One turn of the loop first: the consumer's write of the token just yielded
                # goes out before a step computed in place holds the loop. Without it a
                # one-node stream delivered its tokens in pairs (intervals p10 0.05 ms, p90
                # 15.5 ms; with it 7.6 / 8.4 ms), at no measured cost in tokens/s. Sending a
                # ring's next step before the write saved 0.1-0.2 ms of the gateway's time
                # between steps but no tokens/s (A/B, 3 rounds): the write then competes
                # with the remote hops for the same cores.
                await trio.lowlevel.checkpoint()
                self.value = await fn(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the generator, which raises it
            self.error = exc
        finally:
            self.done.set()

    async def result(self) -> dict[str, Any]:
        if self.call is not None:
            return await self.call()
        await self.done.wait()
        if self.error is not None:
            raise self.error
        if self.value is None:
            raise GenerationError("the generation was stopped while a step was running")
        return self.value

    async def cancel(self) -> None:
        if self.call is None:
            self.scope.cancel()
            await self.done.wait()


class _Run:
    """The route of one generation, rebuilt on failure."""

    def __init__(self, gen: SwarmGenerator, model: str, max_tokens: int,
                 sampling: dict[str, Any], logprobs: int, progress: Progress) -> None:
        self.gen, self.model, self.max_tokens = gen, model, max_tokens
        self.sampling, self.logprobs, self.progress = sampling, logprobs, progress
        self.route: Route | None = None
        self.sid = ""
        self.busy = ""
        self.steps = 0
        """Steps sent on this route (every RELAY_EVERY-th decode step is relayed)."""
        self.answered = 0.0
        """When the last step's token arrived (time.monotonic; 0 before the first)."""
        self.units: Counter[str] = Counter()
        """Peer -> units of work done for this generation, every route's hops included."""
        self.positions: Counter[int] = Counter()
        """Hop index on the current route -> positions it computed (bounds its experts)."""

    def work(self) -> tuple[HopWork, ...]:
        """The units each peer did, with its time per token as this node measured it (the
        hop's own relayed timing where there is one, else the whole step's)."""
        p = self.progress
        return tuple(HopWork(peer, units, p.hop_ms.get(peer, p.step_ms))
                     for peer, units in self.units.items() if units > 0)

    def _count(self, n: int) -> None:
        """A step of n positions succeeded on the current route."""
        assert self.route is not None
        for i, hop in enumerate(self.route.hops):
            self.units[hop.peer] += n * (hop.end - hop.first + hop.head)
            self.positions[i] += n

    def _count_experts(self, hop: Hop, i: int, reply: dict[str, Any]) -> None:
        """The expert work hop i's session reports at close, within what it could have sent."""
        reported = reply.get("experts")
        if not isinstance(reported, dict):
            return
        room = self.positions[i] * (hop.end - hop.first) * MAX_EXPERTS_PER_ROW
        for peer, units in reported.items():
            if (isinstance(peer, str) and len(peer) <= 128 and isinstance(units, int)
                    and 0 < units <= room and peer != hop.peer):
                self.units[peer] += units
                room -= units

    async def begin(self, history: list[int]) -> dict[str, Any]:
        """Open the first route and prefill the prompt (failing over like a step)."""
        try:
            return await self.start(history, 0, first=True)
        except HopFailed as exc:
            return await self._failover(exc, history, 0)

    async def start(self, history: list[int], produced: int, first: bool = False) -> dict[str, Any]:
        """Plan a route, open its sessions and prefill `history`; return the head's reply."""
        try:
            # a route refused for capacity answers Busy at once; a failed one may wait
            self.route = self.gen.plan() if first or self.busy else await self.gen.replan()
        except NoRoute:
            if self.busy:
                raise Busy(f"every route is out of capacity right now ({self.busy}): "
                           "retry shortly") from None
            if first:
                raise
            raise GenerationError(f"the route failed and no other peers cover the model now "
                                  f"({self.gen.missing()}); the generation stopped") from None
        self.sid = secrets.token_hex(8)
        self.progress.route = self.route.peers
        self.steps = 0
        self.positions = Counter()
        for i, hop in enumerate(self.route.hops):
            await self._call(hop, {
                "op": "open", "sid": f"{self.sid}.{i}", "model": self.model, "first": hop.first,
                "end": hop.end, "embed": hop.embed, "head": hop.head,
                "max_tokens": self.max_tokens, "sampling": self.sampling,
                "logprobs": self.logprobs, "draws": produced,
                "prev": self.route.hops[i - 1].peer if i else ""})
        reply: dict[str, Any] = {}
        for c in range(0, len(history), PREFILL_CHUNK):
            reply = await self._forward(history, c, min(c + PREFILL_CHUNK, len(history)))
        return reply

    async def step(self, history: list[int], start: int, produced: int) -> dict[str, Any]:
        """The next token after `history`, failing over to a new route when a hop fails."""
        try:
            return await self._forward(history, start, len(history))
        except HopFailed as exc:
            return await self._failover(exc, history, produced)

    async def _failover(self, exc: HopFailed, history: list[int], produced: int) -> dict[str, Any]:
        """Replace the route after `exc` (failover.judge) and replay `history` on the new one."""
        while True:
            self.progress.failovers += 1
            self.busy = judge(exc, self.progress.failovers, me=self.gen.me,
                              max_failovers=self.gen.config.max_failovers,
                              fitness=self.gen.fitness) or self.busy
            log.warning("hop failed: rebuilding the route and replaying", peer=exc.peer,
                        reason=exc.reason[:200], tokens=len(history))
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await self.close()
            try:
                return await self.start(history, produced, first=produced == 0)
            except HopFailed as again:
                exc = again

    async def _forward(self, history: list[int], start: int, end: int) -> dict[str, Any]:
        assert self.route is not None
        hops = self.route.hops
        x: dict[str, Any] = tensors.encode(np.asarray(history[start:end]), "i32")
        self.steps += 1
        if len(hops) > 1 and (end - start > 1 or self.steps % RELAY_EVERY != 1):
            reply = await self._chain(x, history[start:end], start)
        else:
            reply = await self._relay(x, history, start, end)
        self._count(end - start)
        return reply

    async def _relay(self, x: dict[str, Any], history: list[int], start: int,
                     end: int) -> dict[str, Any]:
        """One step relayed hop by hop through this node, each hop timed."""
        assert self.route is not None
        hops = self.route.hops
        reply: dict[str, Any] = {}
        for i, hop in enumerate(hops):
            msg: dict[str, Any] = {"op": "step", "sid": f"{self.sid}.{i}", "start": start, "x": x}
            if hop.head:
                msg["ids"] = history[start:end]
            reply = await self._call(hop, msg)
            if not hop.head:
                x = reply.get("x", {})
        if "token" not in reply or not isinstance(reply["token"], int):
            raise HopFailed(self.route.hops[-1].peer, "the last stage returned no token")
        self.answered = time.monotonic()
        return reply

    async def _chain(self, x: dict[str, Any], ids: list[int], start: int) -> dict[str, Any]:
        """One step forwarded hop to hop; the head's result comes back to our Inbox."""
        assert self.route is not None
        hops, me = self.route.hops, self.gen.me
        ticket = secrets.token_hex(8)
        msg = {"op": "step", "sid": f"{self.sid}.0", "start": start, "x": x, "ids": ids,
               "owner": me, "back": {"ticket": ticket},
               "next": [[h.peer, f"{self.sid}.{i}"] for i, h in enumerate(hops) if i]}
        traced = len(ids) == 1 and self.steps % TRACE_EVERY == 0
        if traced:
            msg["trace"] = []
        began, sent = time.perf_counter(), time.monotonic()
        with self.gen.inbox.expect(ticket, {me, *self.route.peers}) as results:
            if hops[0].peer == me:
                await self.gen.local(me, msg)
            else:
                await self.gen.channels.notify(hops[0].peer, STAGE_PROTOCOL, msg,
                                               self.gen.config.step_timeout_s)
            reply = await self._await_result(results, start + len(ids))
        self.progress.step_ms = round((time.perf_counter() - began) * 1000, 2)
        if "error" in reply:
            raise await self._blame(reply)
        if not isinstance(reply.get("token"), int):
            raise HopFailed(hops[-1].peer, "the last stage returned no token")
        if traced:
            self.gen.traces.add(StepTrace.parse(self.route.peers, sent, reply["at"],
                                                reply.get("trace"), self.answered))
        self.answered = reply["at"]
        return reply

    async def _await_result(self, results: trio.MemoryReceiveChannel[dict[str, Any]],
                            end: int) -> dict[str, Any]:
        """The chain's result; while it is late, check that every hop is alive and working."""
        assert self.route is not None
        hops = self.route.hops
        give_up = trio.current_time() + self.gen.config.step_timeout_s
        wait = max(PROBE_AFTER_S, 2 * self.progress.step_ms / 1000)
        while True:
            with trio.move_on_at(min(give_up, trio.current_time() + wait)):
                return await results.receive()
            wait *= 2
            lagging, reason = await self._probe(end)
            if reason:
                raise HopFailed(hops[lagging].peer, reason)
            if trio.current_time() < give_up:
                continue  # alive: a long prefill, or a result on its way
            if lagging < 0:  # every hop has the step, yet no result came
                lagging = len(hops) - 1
            if hops[lagging].peer == self.gen.me and lagging > 0:
                lagging -= 1  # we never got the step: the hop before us did not send it
            raise HopFailed(hops[lagging].peer, f"no result within "
                            f"{self.gen.config.step_timeout_s:g} s (position {end - 1})")

    async def _ping(self, i: int) -> dict[str, Any]:
        """Hop i's session: {at: positions computed}, or HopFailed when the hop does not
        answer in time (one computing a step in place answers only after it, so the time
        scales with the route's steps)."""
        assert self.route is not None
        peer, msg = self.route.hops[i].peer, {"op": "ping", "sid": f"{self.sid}.{i}"}
        if peer == self.gen.me:
            return await self.gen.local(peer, msg)
        wait_s = max(PROBE_TIMEOUT_S, 3 * self.progress.step_ms / 1000)
        return await self.gen.channels.request(peer, STAGE_PROTOCOL, msg, wait_s)

    async def _probe(self, end: int) -> tuple[int, str]:
        """Ping every hop: (index, why) of the first that does not answer, else (index, "")
        of the first that has not computed up to `end`, else (-1, "")."""
        assert self.route is not None
        first_behind = -1
        for i, hop in enumerate(self.route.hops):
            try:
                pong = await self._ping(i)
            except HopFailed as exc:
                if hop.peer != self.gen.me:
                    return i, f"stopped answering during a step ({exc.reason})"
                pong = {}
            if first_behind < 0 and (not isinstance(pong.get("at"), int) or pong["at"] < end):
                first_behind = i
        return first_behind, ""

    async def _blame(self, reply: dict[str, Any]) -> HopFailed:
        """The failure a chain reported, pinned on a peer we checked ourselves.

        A hop reporting its own refusal is taken at its word. A hop saying it could not
        reach the next one is believed only if the next one does not answer us either;
        otherwise the reporter (or its link) is the broken part.
        """
        reporter, accused = str(reply["from"]), str(reply.get("peer", ""))
        code, detail = str(reply.get("code", "bad")), str(reply["error"])[:500]
        if accused in ("", reporter):
            return Refused(reporter, code, detail)
        assert self.route is not None
        index = next((i for i, h in enumerate(self.route.hops) if h.peer == accused), None)
        if index is None:
            return HopFailed(reporter, f"blamed a peer that is not on the route: {detail}")
        if accused != self.gen.me:
            try:
                await self._ping(index)
            except HopFailed:
                return HopFailed(accused, detail)
        why = f"could not forward to a peer that answers us: {detail}"
        # not reaching a peer we reach is a missing link (perhaps not dialled yet): the short
        # sentence; a link that broke mid-step is the reporter's failure
        return Unreachable(reporter, why) if code == "unreachable" else HopFailed(reporter, why)

    async def _call(self, hop: Hop, msg: dict[str, Any]) -> dict[str, Any]:
        began = time.perf_counter()
        if hop.peer == self.gen.me:
            try:
                reply = await self.gen.local(self.gen.me, msg)
            except Refused as exc:
                raise Refused(hop.peer, exc.code, exc.detail) from None
        else:
            timeout = self.gen.config.step_timeout_s
            reply = await self.gen.channels.request(hop.peer, STAGE_PROTOCOL, msg, timeout)
        ms = (time.perf_counter() - began) * 1000
        if msg["op"] == "step":
            self.progress.hop_ms[hop.peer] = round(ms, 2)
            if hop.peer != self.gen.me:
                self.gen.latency.observe(hop.peer, ms)
        return reply

    async def close(self) -> None:
        if self.route is None:
            return
        route, self.route = self.route, None
        for i, hop in enumerate(route.hops):
            try:
                with trio.move_on_after(1):
                    self._count_experts(hop, i, await self._call(
                        hop, {"op": "close", "sid": f"{self.sid}.{i}"}))
            except HopFailed:
                pass
