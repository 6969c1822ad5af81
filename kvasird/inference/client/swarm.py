"""SwarmGenerator: the Generator that runs a request along a route of peers.

    plan route (routing.plan_route over online holders, our latencies, fit peers only)
      ─▶ open every hop's session at once ─▶ prefill the prompt ─▶ decode token by token
      each step: gateway ─x─▶ hop 1 ─h─▶ hop 2 ─h─▶ … ─▶ last hop samples ─token─▶ gateway

Boundaries go stage to stage: the gateway sends a step to the first hop with the rest
of the route (`next`) and a ticket; each hop computes, sends its hidden rows straight
to the next one, and the last (the head) returns only the sampled token (and logprobs)
to the gateway's Inbox, all as one-way messages. On the 3-stage ring of the bundled
model (gateway on the first stage, holding the head) a token costs 3 one-way messages
where relaying every boundary through the gateway cost 4, and between machines one
network latency less per token: a chain of n remote hops pays n+1 link latencies, not 2n.
The messages are kvasird.inference.protocol.stage's types: the generator writes its own
as those, and reads every reply as one before using it (a malformed reply is the hop's
failure). A hop on this node itself is a direct call (no framing, no network; its
messages are parsed like any peer's), and it forwards like any other.

What relaying gave for free is kept by other means:
- which hop failed: a hop that cannot reach the next one reports it by name (the gateway
  checks the accusation with a ping of its own), a hop handed NaN rows names the hop
  before it (failover.Accusations weighs that); a chain that goes silent is probed by
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

Spot checks (spotcheck): the first prompt chunk of every route is relayed hop by hop, so
the gateway sees what each hop was given and answered; each hop is drawn for a check with
probability ``[inference] spot_check_stages``, recomputed by other holders of its part
(this node first) in throwaway sessions and compared under ``spot_tolerance``. A hop
caught gets nothing for the generation (`work` leaves it out), is avoided for unfit_s and
accused on gossip, and the generation is replayed on a route without it; the checkers'
work is counted like any hop's. A hop drawn that nobody else can recompute is counted
as unchecked (the status page names it). The relayed chunk is a request per hop: a hop
that hangs during it is found at the step timeout, not by the probe of a chain. A hop can
tell that chunk, so the rest is checked by commit and reveal (`_Run.check_decode`): every
hop writes down each step it computes (server.ledger) and commits to the digests of its
inputs and outputs when its session closes; the gateway compares each hop's outputs with
the next hop's inputs, has a drawn hop show its rows up to a step drawn among the later
ones, and recomputes that step from them on other holders of its part. A hop that cannot
show its work is paid nothing for the generation.

Failover: when a hop fails, times out or refuses, its peer is avoided for a while
(failover.judge), sessions on the old route are closed, a new route is planned, and the
token history is replayed there exactly as it was first computed: the prompt in the
same prefill chunks, then the generated tokens as one step the stages compute a
position at a time (Step.singly), as the decode steps they were, because a batch of T
positions rounds differently from T steps of one. So the new route's KV holds the same
bits as the old one's, its head has drawn from the seeded sampling stream as often as
the old one had, and greedy and seeded generations continue with the tokens an
undisturbed run gives. A replayed token costs one step of one position at each hop
(compute only: the replay is one message per hop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import trio

from kvasird.compute.kv.keys import PAGE, page_keys
from kvasird.compute.sampling import SamplingParams
from kvasird.config import InferenceConfig
from kvasird.errors import WireError
from kvasird.inference.api import (
    Busy,
    EmbeddingRequest,
    Finished,
    GenerationError,
    GenerationRequest,
    HopWork,
    ModelInfo,
    NoRoute,
    TokenEvent,
    UnknownModel,
    check_embedding_input,
)
from kvasird.inference.client.affinity import (
    PREFILL_MS_PER_TOKEN,
    PrefixRoutes,
    hop_keys,
    prefer,
)
from kvasird.inference.client.failover import Accusations, Lied, judge
from kvasird.inference.client.routing import (
    AVOIDED_MS,
    EWMA,
    Fitness,
    Hop,
    Latency,
    PeerHoldings,
    Route,
    plan_route,
    uncovered,
)
from kvasird.inference.client.speculate import PRIOR_ACCEPT, DraftModel, Estimates, Speculator
from kvasird.inference.client.spotcheck import (
    Counts,
    Output,
    Seen,
    SpotChecks,
    agrees,
    as_array,
    cover,
    unit_name,
)
from kvasird.inference.errors import HopFailed, Refusal, Refused, Silent, Unreachable
from kvasird.inference.protocol import STAGE_PROTOCOL, tensors
from kvasird.inference.protocol.delegation import Issuer, life_s
from kvasird.inference.protocol.stage import (
    MAX_TOP,
    STEP_DIGESTS,
    Close,
    Closed,
    Failure,
    Forward,
    Hidden,
    Open,
    Opened,
    Ping,
    Pong,
    Result,
    Reveal,
    Revealed,
    Shown,
    Step,
    tokens_from_wire,
)
from kvasird.inference.protocol.tensors import DIGEST_BYTES, digest
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
CLOSE_S = 5.0
"""How long the hops of a route that ended get to answer its close (with their
commitment, without which they are not paid)."""
FAST_START_RTT_MS = 15.0
"""A route with a remote hop at least this far (heartbeat round trip) opens its hops'
sessions with the first prompt chunk, which travels hop to hop (Step.open): the first token
then costs one circuit of the ring after the prefill, not a round trip to open and two per
hop to relay the chunk. Its spot checks of that chunk come after the generation, by commit
and reveal, as the later steps' do. Nearer routes (a LAN, loopback) keep the relayed,
checked-before-going-on first chunk: a round trip there costs less than a millisecond."""
REPLAN_EVERY_S = 0.25
"""How often a failed-over generation without a route looks at the coverage map again."""
log = get_logger("kvasird.inference.client.swarm")

LocalHandler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
Accuse = Callable[[str, str], Awaitable[None]]


Drawn = tuple[TokenEvent, ...]
"""The tokens a head drew for one step: one, or a speculative step's several."""


@dataclass(frozen=True)
class Done:
    """A step of the current route that succeeded (every hop computed it)."""

    start: int
    ids: tuple[int, ...]
    """The token ids sent (a speculative step's guesses included)."""
    singly: bool
    verify: bool
    tokens: tuple[int, ...]
    """The tokens the head drew."""

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


@dataclass(frozen=True)
class Arrival:
    """A forwarded chain's outcome, as the Inbox took it in."""

    result: Result | Failure
    sender: str
    """The peer it came from (by its connection, not by anything it said)."""
    at: float
    """When it arrived (time.monotonic)."""


class Inbox:
    """Results of forwarded steps, by ticket, for the generations waiting on them.

    A result is taken only from a peer on the waiting route (or this node); anything else
    (a late result of a step given up on, a stranger) is dropped.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[frozenset[str], trio.MemorySendChannel[Arrival]]] = {}
        self.dropped = 0

    @contextlib.contextmanager
    def expect(
        self, ticket: str, peers: Iterable[str]
    ) -> Iterator[trio.MemoryReceiveChannel[Arrival]]:
        send, recv = trio.open_memory_channel[Arrival](1)
        self._waiting[ticket] = (frozenset(peers), send)
        try:
            yield recv
        finally:
            self._waiting.pop(ticket, None)

    def deliver(self, sender: str, result: Result | Failure) -> None:
        waiting = self._waiting.get(result.ticket)
        if waiting is None or sender not in waiting[0]:
            self.dropped += 1
            return
        with contextlib.suppress(trio.WouldBlock):
            waiting[1].send_nowait(Arrival(result, sender, time.monotonic()))


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
    guessed: int = 0
    """Tokens guessed by speculation so far (client.speculate)."""
    accepted: int = 0
    """Of those, accepted by the head."""


class SwarmGenerator:
    """Generates across the peers that hold the model, from this node's coverage map."""

    def __init__(
        self,
        me: str,
        info: Callable[[], ModelInfo | None],
        n_layer: Callable[[], int],
        holders: Callable[[], list[PeerHoldings]],
        channels: Channels,
        local: LocalHandler,
        latency: Latency,
        fitness: Fitness,
        config: InferenceConfig,
        inbox: Inbox,
        *,
        spot: SpotChecks | None = None,
        accuse: Accuse | None = None,
        issuer: Issuer | None = None,
        draft: DraftModel | None = None,
        speculable: Callable[[], str] = lambda: "",
    ) -> None:
        self.me, self.info, self.n_layer, self.holders = me, info, n_layer, holders
        self.channels, self.local, self.inbox = channels, local, inbox
        self.latency, self.fitness, self.config = latency, fitness, config
        self.active: dict[str, Progress] = {}
        self.traces = Traces()
        """Where the traced steps' time went (steptrace)."""
        self.first_traces = Traces()
        """Where the time of first prompt chunks that opened their route went (a route of
        far peers: the opens travel with the chunk, which is traced)."""
        self._work: dict[str, tuple[HopWork, ...]] = {}
        self.accusations = Accusations(me)
        """Which hops accused which of sending them NaN, lately (failover.Accusations)."""
        self.nursery: trio.Nursery | None = None
        """Where steps run ahead of the consumer (set by the service once it runs)."""
        self.prefixes = PrefixRoutes()
        """Which route holds each prompt prefix this node sent (prefix affinity)."""
        self.prefill_ms = PREFILL_MS_PER_TOKEN
        """Prefill time per prompt token (EWMA of the prefills this node ran)."""
        self.reused = 0
        """Prompt positions that generations started from a kept prefix, since start."""
        self.spot = spot or SpotChecks(
            config.spot_check_stages, config.spot_check, config.spot_tolerance
        )
        """Spot checks of the stages (the evidence of those caught, the units unchecked)."""
        self.accuse = accuse
        """Tells the network of a stage caught by a spot check (verdicts), when set."""
        self.issuer = issuer
        """Signs each hop's delegation at open (protocol.delegation); without one the opens
        carry none, and hops that send expert rows to other peers cannot step."""
        self.draft = draft
        """The draft model speculation guesses with ([inference] draft_model), if any."""
        self.speculable = speculable
        """Why the model cannot be speculated on ("" when it can: see speculate)."""
        self.estimates: dict[str, Estimates] = {}
        """What speculation measured, per source (routes from one node are mostly one)."""
        self.speculation = Counter[str]()
        """Since start: "steps" speculated, tokens "guessed" and "accepted"."""

    def models(self) -> list[ModelInfo]:
        info = self.info()
        return [info] if info is not None else []

    def work(self, request_id: str) -> tuple[HopWork, ...]:
        return self._work.pop(request_id, ())

    def resolve(self, name: str) -> ModelInfo:
        info = self.info()
        if info is not None and (name == "" or info.answers_to(name)):
            return info
        known = f"{info.model_id} ({info.label})" if info else "none (set [market] model)"
        raise UnknownModel(f"model {name!r} is not known here; this node routes {known}")

    def _fit(self) -> list[PeerHoldings]:
        return [h for h in self.holders() if self.fitness.fit(h.peer)]

    def plan(self, last_resort: bool = True, prefix: bytes = b"", steps: int = 0) -> Route:
        """The cheapest route over fit peers; when there is none (and `last_resort`), the
        cheapest that needs peers avoided after one failure: a slow or just restarted peer
        beats no route (a sentence for failing once is a preference, not a ban). Never
        one through a liar, or a peer that failed twice in a row. With a prompt's page
        keys (`prefix`), the route that holds its longest prefix when that is cheaper
        over `steps` decode steps (affinity.prefer)."""
        fit = self._fit()
        route = plan_route(self.n_layer(), fit, self.latency)
        if route is not None and prefix:
            route = prefer(
                route, self.prefixes.recall(prefix), fit, self.latency, steps, self.prefill_ms
            )
        if route is None and last_resort:
            fitness = self.fitness
            second_chance = [h for h in self.holders() if fitness.second_chance(h.peer)]
            route = plan_route(
                self.n_layer(),
                second_chance,
                lambda p: self.latency(p) + (0.0 if fitness.fit(p) else AVOIDED_MS),
            )
            if route is not None:
                log.info(
                    "no route without peers that failed lately: trying one through them",
                    avoided=[p for p in route.peers if not fitness.fit(p)],
                )
        if route is None:
            raise NoRoute(
                f"the online peers do not cover the model ({self.missing()}): see "
                "`kvasird coverage`, and retry when the market has filled the gaps"
            )
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
        loading), so wait up to the step timeout for one, through peers that failed lately
        only after half of it (the one that just failed is likely among them)."""
        give_up = trio.current_time() + self.config.step_timeout_s
        last_resort = trio.current_time() + self.config.step_timeout_s / 2
        waited = False
        while True:
            try:
                return self.plan(last_resort=trio.current_time() >= last_resort)
            except NoRoute as exc:
                if trio.current_time() >= give_up:
                    raise
                if not waited:
                    log.warning(
                        "no route to fail over to yet: waiting for coverage",
                        why=str(exc),
                        holders=len(self.holders()),
                    )
                    waited = True
                await trio.sleep(REPLAN_EVERY_S)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | Finished]:
        info = self.resolve(request.model)
        s = request.sampling
        n_prompt = len(request.prompt)
        budget = min(s.max_tokens, info.context_length - n_prompt)
        if n_prompt == 0 or budget < 1:
            raise Busy(
                f"the prompt of {n_prompt} tokens leaves no room in the context of "
                f"{info.context_length}: shorten it"
            )
        rid = request.request_id or secrets.token_hex(8)
        progress = self.active[rid] = Progress()
        # every route the generation takes draws from the same seeded stream
        params = (
            s.params
            if s.params.seed is not None
            else dataclasses.replace(s.params, seed=secrets.randbits(62))
        )
        run = _Run(self, info.model_id, n_prompt + budget, params, s.logprobs, progress)
        run.spec = self._speculator()
        if run.spec is not None:
            run.spec.prepare(self.nursery, request.prompt)
        history, produced, reason = list(request.prompt), 0, "length"
        pending: _Pending | None = None
        try:
            events, ended = await run.begin(history), False
            while not ended:
                for i, event in enumerate(events):  # a speculative step draws several
                    if event.token in request.stop_tokens:
                        reason, ended = "stop", True
                        break
                    produced += 1
                    history.append(event.token)
                    ended = produced >= budget
                    if not ended and i == len(events) - 1:
                        # the next step runs while the consumer handles this token
                        pending = _Pending.start(
                            self.nursery, run.step, history, len(history) - 1, produced
                        )
                    yield event
                    progress.tokens = produced
                    if ended:
                        break
                if not ended:
                    assert pending is not None
                    events = await pending.result()
                    pending = None
            yield Finished(reason, n_prompt, produced, run.cached)
        finally:
            self.active.pop(rid, None)
            with trio.CancelScope(shield=True):
                if pending is not None:
                    with trio.move_on_after(2):
                        await pending.cancel()
                if run.spec is not None:
                    await run.spec.aclose()
                await run.close()
                await run.check_decode()
                if len(self._work) >= KEEP_WORK:  # never asked for: drop the oldest
                    del self._work[next(iter(self._work))]
                self._work[rid] = run.work()

    async def embed(self, request: EmbeddingRequest) -> list[np.ndarray]:
        """Each input through a route in embedding sessions (Open.embeddings): its chunks
        relayed hop by hop, the head answering every position's final-norm row. A hop that
        fails is replaced and the input computed again on the new route. The work of all
        inputs is reported as one request's."""
        info = self.resolve(request.model)
        rid = request.request_id or secrets.token_hex(8)
        progress = self.active[rid] = Progress()
        out: list[np.ndarray] = []
        units: Counter[str] = Counter()
        try:
            for ids in request.inputs:
                check_embedding_input(ids, info.context_length)
                run = _Run(self, info.model_id, len(ids), SamplingParams(), 0, progress)
                try:
                    out.append(await run.embed(ids))
                finally:
                    with trio.CancelScope(shield=True):
                        await run.close()
                    units += run.units
        finally:
            self.active.pop(rid, None)
            if len(self._work) >= KEEP_WORK:
                del self._work[next(iter(self._work))]
            self._work[rid] = tuple(
                HopWork(peer, n, progress.hop_ms.get(peer, progress.step_ms))
                for peer, n in units.items()
            )
        return out

    def _speculator(self) -> Speculator | None:
        """This generation's speculation ([inference] speculate), or None."""
        mode = self.config.speculate
        if mode == "off" or self.speculable():
            return None
        draft = self.draft if mode in ("draft", "auto") else None
        if mode == "draft" and draft is None:
            return None
        source = "draft" if draft is not None else "lookup"
        estimates = self.estimates.setdefault(source, Estimates(prior=PRIOR_ACCEPT[source]))
        return Speculator(source, estimates, draft, self.config.draft_k)


class _Pending:
    """A step running ahead in the service's nursery while the caller yields a token.

    Without a nursery (a generator used outside the daemon) the step runs when awaited.
    """

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.value: Drawn | None = None
        self.error: Exception | None = None
        self.call: Callable[[], Awaitable[Drawn]] | None = None

    @classmethod
    def start(
        cls, nursery: trio.Nursery | None, fn: Callable[..., Awaitable[Drawn]], *args: Any
    ) -> _Pending:
        p = cls()
        if nursery is None:
            p.call = lambda: fn(*args)
        else:
            nursery.start_soon(p._run, fn, args)
        return p

    async def _run(self, fn: Callable[..., Awaitable[Drawn]], args: tuple) -> None:
        try:
            with self.scope:
                # One turn of the loop first: the consumer's write of the token just yielded
                # goes out before a step computed in place holds the loop. Without it a
                # one-node stream delivered its tokens in pairs (every other interval near
                # zero), at no measured cost in tokens/s. Sending a ring's next step before
                # the write saved some of the gateway's time between steps but no tokens/s
                # (bench/bench_swarm.py, A/B): the write then competes with the remote hops
                # for the same cores.
                await trio.lowlevel.checkpoint()
                self.value = await fn(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the generator, which raises it
            self.error = exc
        finally:
            self.done.set()

    async def result(self) -> Drawn:
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

    def __init__(
        self,
        gen: SwarmGenerator,
        model: str,
        max_tokens: int,
        sampling: SamplingParams,
        logprobs: int,
        progress: Progress,
    ) -> None:
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
        self.history: list[int] = []
        """The tokens fed to the route (the generation's history, shared)."""
        self.cached = 0
        """Prompt positions the first route started from a kept prefix (not computed)."""
        self.produced = 0
        """Tokens generated before the current route started (0 on the first route)."""
        self.caught: set[str] = set()
        """Peers caught out of tolerance by a spot check in this generation: whatever they
        did for it is paid to nobody."""
        self.drawn: tuple[tuple[Hop, ...], tuple[Hop, ...]] = ((), ())
        """The current route's hops, and those of them drawn for a spot check (checked on
        its first prompt chunk at once, on its decode steps once the generation ends)."""
        self.done: list[Done] = []
        """The current route's steps that succeeded, in order. Every hop computed each of
        them: its ledger's steps."""
        self.spec: Speculator | None = None
        """This generation's speculation, when on (client.speculate)."""
        self.riding: dict[int, Open] = {}
        """Hop index -> its Open, for the hops whose sessions open with the route's first
        step (FAST_START_RTT_MS); emptied once that step's result is in."""
        self.unaudited = False
        """The current route's first prompt chunk was forwarded, not relayed: the hops
        drawn for a spot check have it checked after the generation (check_decode)."""
        self.relayed: dict[int, tuple[bytes, ...]] = {}
        """Step index -> the digest of what this node sent each hop, for the current route's
        steps relayed through it (what hop i answered is what hop i + 1 was sent)."""
        self.commits: dict[int, bytes] = {}
        """Hop index -> its commitment to its steps (Closed.steps), once its session closed."""
        self.opened = (0, 0)
        """(draws, prompt) the current route's sessions were opened with."""
        self.began = 0
        """Where the current route's prefill began (> 0: from a kept prefix)."""
        self.unshown: set[str] = set()
        """Peers of the last route that could not show their work (check_decode): paid
        nothing for the generation."""
        self.claims: list[tuple[str, int, tuple[tuple[str, int], ...]]] = []
        """(stage, the expert units its layers could have dispatched, those its Close
        reported) of every session closed: counted by `work`, unless the stage is caught
        (a decode check's verdict comes after the close)."""

    def work(self) -> tuple[HopWork, ...]:
        """The units each peer did, with its time per token as this node measured it (the
        hop's own relayed timing where there is one, else the whole step's); none for a
        peer caught by a spot check."""
        p, units = self.progress, self.units.copy()
        unpaid = self.caught | self.unshown
        for stage, room, experts in self.claims:
            if stage in unpaid:  # its word is worth nothing
                continue
            for peer, n in experts:
                if n <= room and peer != stage:
                    units[peer] += n
                    room -= n
        return tuple(
            HopWork(peer, n, p.hop_ms.get(peer, p.step_ms))
            for peer, n in units.items()
            if n > 0 and peer not in unpaid
        )

    def _count(self, n: int) -> None:
        """A step of n positions succeeded on the current route."""
        assert self.route is not None
        strikes = self.gen.fitness.strikes
        for i, hop in enumerate(self.route.hops):
            self.units[hop.peer] += n * (hop.end - hop.first + hop.head)
            self.positions[i] += n
            if strikes and hop.peer in strikes:
                self.gen.fitness.healthy(hop.peer)

    def _count_experts(self, hop: Hop, i: int, closed: Closed) -> None:
        """The expert work hop i's session reports at close, and what it could have sent
        (counted by `work`, within that)."""
        room = self.positions[i] * (hop.end - hop.first) * MAX_EXPERTS_PER_ROW
        self.claims.append((hop.peer, room, tuple(closed.experts)))

    async def begin(self, history: list[int]) -> Drawn:
        """Open the first route and prefill the prompt (failing over like a step)."""
        try:
            return await self.start(history, 0, first=True)
        except HopFailed as exc:
            return await self._failover(exc, history, 0)

    async def start(self, history: list[int], produced: int, first: bool = False) -> Drawn:
        """Plan a route, open its sessions and prefill `history`; return the head's token.

        On a first route the hops may hold the prompt's start (prefix reuse): the prefill
        then begins at the last page every hop holds (a multiple of PAGE, so each row sits
        where it sits in a cold prefill's chunks modulo any kernel's row blocking, and the
        prompt's last chunk ends where a cold one's does: the logprobs are the cold
        ones bit for bit, tests/integration/test_prefix.py). A replay after a failover
        starts from nothing, so that the new route's KV holds the bits the old one's did."""
        gen, prompt = self.gen, len(history) - produced
        self.history, self.produced, self.drawn = history, produced, ((), ())
        # the pages before the prompt's last token: it is computed whatever a hop holds,
        # and a delta-net's state cannot go back to it from the page after
        keys = page_keys(history[: prompt - 1]) if first and gen.config.prefix_cache else b""
        try:
            # a route refused for capacity answers Busy at once; a failed one may wait
            self.route = (
                gen.plan(prefix=keys, steps=self.max_tokens - prompt)
                if first or self.busy
                else await gen.replan()
            )
        except NoRoute:
            if self.busy:
                raise Busy(
                    f"every route is out of capacity right now ({self.busy}): retry shortly"
                ) from None
            if first:
                raise
            raise GenerationError(
                f"the route failed and no other peers cover the model now "
                f"({gen.missing()}); the generation stopped"
            ) from None
        self.sid = secrets.token_hex(8)
        self.riding, self.unaudited = {}, False
        self.progress.route = self.route.peers
        self.steps = 0
        self.done, self.commits, self.relayed = [], {}, {}
        self.opened = (max(produced - 1, 0), prompt)
        self.positions = Counter()
        route = self.route
        fast = self._fast(route, keys)
        if fast:
            keys = b""

        def opening(i: int, hop: Hop) -> Open:
            return Open(
                f"{self.sid}.{i}",
                self.model,
                hop.first,
                hop.end,
                hop.embed,
                hop.head,
                self.max_tokens,
                self.logprobs,
                route.hops[i - 1].peer if i else "",
                self.sampling,
                max(produced - 1, 0),
                prompt,
                hop_keys(keys, route, i) if keys else b"",
                gen.issuer.issue(hop.peer, life_s(self.max_tokens)) if gen.issuer else b"",
            )

        if fast:  # this node's own session now (no round trip); the others with the chunk
            if route.hops[0].peer == gen.me:
                _read(
                    gen.me,
                    Opened.from_wire,
                    await self._call(route.hops[0], opening(0, route.hops[0])),
                )
            self.riding = {
                i: opening(i, hop) for i, hop in enumerate(route.hops) if i or hop.peer != gen.me
            }
            spot = gen.spot
            self.drawn = (
                route.hops,
                tuple(h for h in route.hops if h.peer != gen.me and spot.draw(spot.stages, h.peer)),
            )
            self.unaudited = True
            starts: dict[int, int] = {}
        else:
            starts = await self._open_route(opening)
        cached = min([prompt, *starts.values()])
        begin = min(cached, prompt - 1) // PAGE * PAGE if keys else 0
        self.began = begin
        gen.reused += begin
        if first:
            self.cached = begin
        began = time.perf_counter()
        for c in range(begin, prompt, PREFILL_CHUNK):
            event = await self._forward(
                history, c, min(c + PREFILL_CHUNK, prompt), audit=c == begin and not fast
            )
        if prompt - begin >= PREFILL_CHUNK:  # long enough to say what a prefill costs
            ms = (time.perf_counter() - began) * 1000 / (prompt - begin)
            gen.prefill_ms = (1 - EWMA) * gen.prefill_ms + EWMA * ms
        if produced:
            event = await self._forward(history, prompt, len(history), singly=True)
        return event

    async def embed(self, ids: tuple[int, ...]) -> np.ndarray:
        """`ids`' final-norm rows through a route of embedding sessions, failing over."""
        failovers = 0
        while True:
            try:
                return await self._embed_once(ids)
            except HopFailed as exc:
                failovers += 1
                self.busy = (
                    judge(
                        exc,
                        failovers,
                        me=self.gen.me,
                        max_failovers=self.gen.config.max_failovers,
                        fitness=self.gen.fitness,
                    )
                    or self.busy
                )
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await self.close()

    async def _embed_once(self, ids: tuple[int, ...]) -> np.ndarray:
        gen = self.gen
        self.route = route = gen.plan() if not self.busy else await gen.replan()
        self.sid, self.steps = secrets.token_hex(8), 0
        self.progress.route = route.peers

        await self._open_route(
            lambda i, hop: Open(
                f"{self.sid}.{i}",
                self.model,
                hop.first,
                hop.end,
                hop.embed,
                hop.head,
                len(ids),
                0,
                route.hops[i - 1].peer if i else "",
                delegation=gen.issuer.issue(hop.peer, life_s(len(ids))) if gen.issuer else b"",
                embeddings=True,
            )
        )
        rows = []
        for c in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[c : c + PREFILL_CHUNK]
            out = await self._through(
                route.hops, self.sid, np.asarray(chunk, np.int32), "i32", chunk, c, rows=True
            )
            if isinstance(out, tuple):
                raise HopFailed(route.hops[-1].peer, "answered tokens to an embedding session")
            rows.append(tensors.widen(out, "embedding"))
            self._count(len(chunk))
        return np.concatenate(rows)

    def _fast(self, route: Route, keys: bytes) -> bool:
        """Whether `route` opens its sessions with the first prompt chunk (FAST_START_RTT_MS):
        a remote hop far enough, delegations to send with the opens, and no kept prefix
        the route would start from (whose length only the open's answer tells)."""
        gen = self.gen
        if gen.issuer is None or (keys and gen.prefixes.recall(keys) is not None):
            return False
        far = [gen.latency.rtt(p) for p in route.peers if p != gen.me]
        return any(rtt is not None and rtt >= FAST_START_RTT_MS for rtt in far)

    async def _open_route(self, opening: Callable[[int, Hop], Open]) -> dict[int, int]:
        """Every hop's session on the current route at once (one round trip before the
        first step, not one a hop): hop index -> the positions it starts with (kept). The
        first failed hop on the route is raised; the failover closes the others."""
        assert self.route is not None
        starts: dict[int, int] = {}
        failed: list[tuple[int, HopFailed]] = []

        async def open_hop(i: int, hop: Hop) -> None:
            try:
                reply = await self._call(hop, opening(i, hop))
                starts[i] = _read(hop.peer, Opened.from_wire, reply).cached
            except HopFailed as exc:
                failed.append((i, exc))

        async with trio.open_nursery() as nursery:
            for i, hop in enumerate(self.route.hops):
                nursery.start_soon(open_hop, i, hop)
        if failed:
            raise min(failed, key=lambda f: f[0])[1]
        return starts

    async def step(self, history: list[int], start: int, produced: int) -> Drawn:
        """The next token after `history` (with speculation, maybe several), failing over
        to a new route when a hop fails (the replay starts from `history`: guesses that were
        in flight are dropped)."""
        spec, guesses = self.spec, tuple[int, ...]()
        if spec is not None:
            guesses = await spec.guess(history, self.max_tokens - len(history))
            spec.draft_ahead(history, guesses)
        began = time.perf_counter()
        try:
            drawn = await self._forward(history, start, len(history), guesses=guesses)
        except HopFailed as exc:
            return await self._failover(exc, history, produced)
        if spec is not None:
            if self.steps % RELAY_EVERY != 1:  # a relayed step's time is not a chain's
                spec.learn(len(guesses), len(drawn), time.perf_counter() - began)
            if guesses:
                gen, p = self.gen, self.progress
                gen.speculation.update(steps=1, guessed=len(guesses), accepted=len(drawn) - 1)
                gen.speculation["ahead"] += spec.take_ahead_hit()
                p.guessed, p.accepted = p.guessed + len(guesses), p.accepted + len(drawn) - 1
        return drawn

    async def _failover(self, exc: HopFailed, history: list[int], produced: int) -> Drawn:
        """Replace the route after `exc` (failover.judge) and replay `history` on the new one."""
        while True:
            self.progress.failovers += 1
            self.busy = (
                judge(
                    exc,
                    self.progress.failovers,
                    me=self.gen.me,
                    max_failovers=self.gen.config.max_failovers,
                    fitness=self.gen.fitness,
                )
                or self.busy
            )
            log.warning(
                "hop failed: rebuilding the route and replaying",
                peer=exc.peer,
                reason=exc.reason[:200],
                tokens=len(history),
            )
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await self.close()
            try:
                return await self.start(history, produced, first=produced == 0)
            except HopFailed as again:
                exc = again

    async def _forward(
        self,
        history: list[int],
        start: int,
        end: int,
        singly: bool = False,
        audit: bool = False,
        guesses: tuple[int, ...] = (),
    ) -> Drawn:
        """One step along the route; `audit`: the route's first prompt chunk, relayed and
        spot-checked (`_audited`); `guesses`: a speculative step (Step.verify)."""
        assert self.route is not None
        ids, verify = tuple(history[start:end]) + guesses, bool(guesses)
        singly = singly or verify and self.gen.config.speculate_exact
        self.steps += 1
        if audit:
            drawn = await self._audited(ids, start)
        elif (
            self.riding
            or len(self.route.hops) > 1
            and (len(ids) > 1 and not verify or self.steps % RELAY_EVERY != 1)
        ):  # a step carrying its route's opens goes by chain, even through one hop
            drawn = await self._chain(ids, start, singly, verify)
        else:
            drawn = await self._relay(ids, start, singly, verify)
        self._count(len(ids))
        self.done.append(Done(start, ids, singly, verify, tuple(t.token for t in drawn)))
        return drawn

    async def _relay(
        self,
        ids: tuple[int, ...],
        start: int,
        singly: bool = False,
        verify: bool = False,
        trail: list[Seen] | None = None,
    ) -> Drawn:
        """One step relayed hop by hop through this node, each hop timed (and what each was
        given and answered kept in `trail`, when given)."""
        assert self.route is not None
        trail = [] if trail is None else trail
        out = await self._through(
            self.route.hops, self.sid, np.asarray(ids), "i32", ids, start, singly, verify, trail
        )
        if not isinstance(out, tuple):
            raise HopFailed(self.route.hops[-1].peer, "the route ends before the head")
        self.answered = time.monotonic()
        self.relayed[len(self.done)] = tuple(digest(seen.x, seen.dt) for seen in trail)
        return out

    async def _through(
        self,
        hops: tuple[Hop, ...],
        sid: str,
        x: np.ndarray,
        dt: str,
        ids: tuple[int, ...],
        start: int,
        singly: bool = False,
        verify: bool = False,
        trail: list[Seen] | None = None,
        rows: bool = False,
    ) -> Output:
        """`x` through the sessions `sid`.i of `hops`, one request each: the head's tokens,
        or the last hop's rows when none samples (`rows`: an embedding session's head)."""
        for i, hop in enumerate(hops):
            reply = await self._call(
                hop,
                Step(
                    f"{sid}.{i}",
                    start,
                    x,
                    dt,
                    ids if hop.head else None,
                    singly=singly,
                    verify=verify,
                ),
            )
            if hop.head and not rows:
                drawn = _read(hop.peer, _head_reply, reply)
                if trail is not None:
                    trail.append(Seen(hop, x, dt, drawn))
                return drawn
            hidden = _read(hop.peer, Hidden.from_wire, reply)
            if trail is not None:
                trail.append(Seen(hop, x, dt, hidden.x))
            x, dt = hidden.x, hidden.dt
        return x

    async def _audited(self, ids: tuple[int, ...], start: int) -> Drawn:
        """The route's first prompt chunk, relayed hop by hop whether or not it is checked
        (a hop cannot tell the sessions drawn for a check), each hop drawn for a spot check
        with probability ``spot_check_stages``. The checks run at once, side by side, before
        the generation goes on; a hop caught fails the step (Lied), so the generation is
        replayed on a route without it, and its work is paid to nobody."""
        assert self.route is not None
        trail: list[Seen] = []
        event = await self._relay(ids, start, trail=trail)
        spot, me = self.gen.spot, self.gen.me
        drawn = [s for s in trail if s.hop.peer != me and spot.draw(spot.stages, s.hop.peer)]
        self.drawn = (self.route.hops, tuple(s.hop for s in drawn))
        if start > 0:  # the hops began from kept KV, which a checker does not have
            for seen in drawn:
                spot.nobody(spot.stages, f"{unit_name(seen.hop)} (from a kept prefix)")
            return event
        async with trio.open_nursery() as nursery:
            for seen in drawn:
                nursery.start_soon(self._check, seen, ids)
        if caught := [p for p in self.route.peers if p in self.caught]:
            raise Lied(caught[0], "failed a spot check: its output was out of tolerance")
        return event

    async def _check(self, seen: Seen, ids: tuple[int, ...]) -> None:
        """Recompute what hop `seen` did on other holders of its part and compare."""
        await self._judge(
            "stage",
            self.gen.spot.stages,
            seen.hop,
            unit_name(seen.hop),
            seen.x,
            seen.out,
            lambda pieces: self._recompute(pieces, seen, ids),
        )

    async def _judge(
        self,
        kind: str,
        counts: Counts,
        hop: Hop,
        unit: str,
        x: np.ndarray,
        out: Output,
        recompute: Callable[[tuple[Hop, ...]], Awaitable[Output]],
    ) -> None:
        """Compare `out`, what `hop` answered for `x`, with what other holders of its part
        give (`recompute` on the pieces `cover` picks). This node's own recomputation is
        authoritative; a peer's is one opinion, and when it disagrees a second one (other
        holders again) decides: the checked hop is caught when both disagree with it, the
        first checker when it alone (not a chain, where which piece erred is not known) is
        contradicted by the second, nobody when the three disagree or there is no second."""
        spot, me = self.gen.spot, self.gen.me
        greedy = self.sampling.temperature <= 0
        refs: list[tuple[tuple[Hop, ...], Output]] = []
        while len(refs) < 2:
            exclude = {hop.peer, *(p.peer for c, _ in refs for p in c if p.peer != me)}
            pieces = cover(hop, self.gen._fit(), exclude, me, spot.rng)
            if pieces is None:
                break
            try:
                refs.append((pieces, await recompute(pieces)))
            except HopFailed as exc:
                counts.failed += 1
                log.info(
                    "a spot check could not be finished: a hop of its checkers failed",
                    kind=kind,
                    peer=hop.peer,
                    failed=exc.peer,
                    reason=exc.reason[:200],
                )
                return
            ok, diff = agrees(out, refs[-1][1], spot.tolerance, greedy)
            if spot.compared(counts, diff if ok else math.inf):
                if len(refs) > 1 and len(refs[0][0]) == 1:  # the first checker erred
                    await self._condemn(
                        kind,
                        refs[0][0][0].peer,
                        unit,
                        x,
                        refs[0][1],
                        out,
                        [hop.peer, *(p.peer for p in pieces)],
                    )
                elif len(refs) > 1:
                    counts.unresolved += 1
                return
            if all(p.peer == me for p in pieces):
                break
        if not refs:
            spot.nobody(counts, unit)
        elif all(p.peer == me for p in refs[-1][0]) or (
            len(refs) == 2 and agrees(refs[0][1], refs[1][1], spot.tolerance, greedy)[0]
        ):
            await self._condemn(
                kind, hop.peer, unit, x, out, refs[-1][1], [p.peer for c, _ in refs for p in c]
            )
        else:
            counts.unresolved += 1
            log.warning(
                "a spot check disagreed with its checker and nobody else could decide",
                kind=kind,
                peer=hop.peer,
                checkers=[p.peer for c, _ in refs for p in c],
            )

    async def _condemn(
        self,
        kind: str,
        peer: str,
        unit: str,
        x: np.ndarray,
        out: Output,
        ref: Output,
        checkers: list[str],
    ) -> None:
        """`peer` answered `out` for `unit` given `x` where `checkers` computed `ref`: the
        evidence (of `kind`) is kept, nothing it did for this generation is paid, it is
        avoided for unfit_s, and the network hears of it."""
        spot = self.gen.spot
        _, diff = agrees(out, ref, spot.tolerance, self.sampling.temperature <= 0)
        spot.caught(kind, peer, unit, checkers, x, as_array(out), as_array(ref), diff)
        self.caught.add(peer)
        reason = f"failed a spot check of {unit}"
        self.gen.fitness.mark(peer, reason)
        if self.gen.accuse is not None:
            await self.gen.accuse(peer, reason)

    async def _recompute(self, pieces: tuple[Hop, ...], seen: Seen, ids: tuple[int, ...]) -> Output:
        """What `pieces` compute from the input `seen.hop` had, in throwaway sessions (the
        same chunk from position 0, the head drawing as the route's head did); their work is
        counted to them like any hop's."""
        gen, sid, n = self.gen, secrets.token_hex(8), len(ids)
        draws, prompt = max(self.produced - 1, 0), len(self.history) - self.produced
        opened: list[int] = []
        try:
            for j, p in enumerate(pieces):
                _read(
                    p.peer,
                    Opened.from_wire,
                    await self._call(
                        p,
                        Open(
                            f"{sid}.{j}",
                            self.model,
                            p.first,
                            p.end,
                            p.embed,
                            p.head,
                            n,
                            MAX_TOP if p.head else 0,
                            "",
                            self.sampling,
                            draws,
                            prompt,
                            delegation=gen.issuer.issue(p.peer, life_s(n)) if gen.issuer else b"",
                        ),
                    ),
                )
                opened.append(j)
            out = await self._through(pieces, sid, seen.x, seen.dt, ids, 0)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                for j in opened:
                    with contextlib.suppress(HopFailed):
                        await self._call(pieces[j], Close(f"{sid}.{j}"))
        for p in pieces:
            self.units[p.peer] += n * (p.end - p.first + p.head)
        return out

    async def check_decode(self) -> None:
        """The last route's steps after its first prompt chunk (which a hop can tell: it is
        relayed), checked once the generation has ended and its sessions closed, before its
        work is handed to settlement: commit and reveal (server.ledger).

        Every hop's commitment (Closed.steps) is compared with its neighbours' and with what
        this node sent and received (`_match`). Each hop drawn at the first chunk is then
        asked to show its steps up to one drawn among the later ones (a hop cannot tell
        which: it committed to all of them before the draw was made known), the rows are
        checked against its commitment, and the drawn step is recomputed from the inputs
        it shows on other holders of its part (`_rebuild`) and compared under the
        tolerance, as the first chunk is (`_judge`). What the replay of a whole route
        could not do, this does on a route of any peers: the hop's inputs are bound by
        the hop before it, so a disagreement names the hop checked. A route that started
        from a kept prefix is not checked (no checker has the KV before it). On a route
        whose first chunk was forwarded (FAST_START_RTT_MS), each drawn hop's first chunk is
        checked here too, as the stage check it would have had."""
        hops, drawn = self.drawn
        if not hops:
            return
        self._match(hops)
        spot = self.gen.spot
        for hop in drawn:
            if self.unaudited and self.done and hop.peer not in self.unshown:
                await self._check_shown(hops, hop, 0, "stage", spot.stages)
            if hop.peer in self.caught or hop.peer in self.unshown or len(self.done) < 2:
                continue
            spot.decode.seen += 1
            if self.began:
                spot.nobody(spot.decode, f"{unit_name(hop)} (decode steps, from a kept prefix)")
                continue
            await self._check_shown(hops, hop, spot.rng.randrange(1, len(self.done)))

    def _match(self, hops: tuple[Hop, ...]) -> None:
        """Every hop must have committed to each step of the route, its inputs the outputs
        the hop before it committed to (the first hop's the token ids this node sent, the
        head's outputs the tokens it returned here). A hop without a commitment, or whose
        commitment contradicts this node's own knowledge or its own hop's, cannot show its
        work and is paid nothing for the generation; of two other peers that contradict
        each other, which lied about the rows between them is not known, and neither is
        paid."""
        d, n, me = DIGEST_BYTES, len(self.done), self.gen.me

        def digest_of(i: int, step: int, out: int) -> bytes:
            at = step * STEP_DIGESTS + out * d
            return self.commits[i][at : at + d]

        bad: dict[str, str] = {}
        for i, hop in enumerate(hops):
            if len(self.commits.get(i, b"")) < n * STEP_DIGESTS:
                bad[hop.peer] = "no commitment to every step it computed"
        last = len(hops) - 1
        for step, done in enumerate(self.done):
            if hops[0].peer not in bad and digest_of(0, step, 0) != digest(
                np.asarray(done.ids, np.int32), "i32"
            ):
                bad[hops[0].peer] = f"committed to inputs this node did not send (step {step})"
            if hops[last].peer not in bad and digest_of(last, step, 1) != digest(
                np.array(done.tokens, np.int32), "i32"
            ):
                bad[hops[last].peer] = f"committed to tokens it did not return (step {step})"
            known = self.relayed.get(step)
            for i in range(last):
                p, q = hops[i].peer, hops[i + 1].peer
                if known is not None:  # relayed: this node saw what went between them
                    for peer, j, out in ((p, i, 1), (q, i + 1, 0)):
                        if peer not in bad and digest_of(j, step, out) != known[i + 1]:
                            bad[peer] = (
                                f"committed to rows other than those it "
                                f"{'sent' if out else 'was sent'} (step {step})"
                            )
                    continue
                if p in bad or q in bad or digest_of(i, step, 1) == digest_of(i + 1, step, 0):
                    continue
                why = f"its commitment contradicts its neighbour's (step {step})"
                for peer in [x for x in (p, q) if me not in (p, q) or x != me]:
                    bad[peer] = why
        for peer, why in bad.items():
            if peer != me and peer not in self.unshown:
                self._unshown(peer, why)

    def _unshown(self, peer: str, why: str) -> None:
        """`peer` could not show its work for the generation: it is paid nothing for it."""
        self.unshown.add(peer)
        self.gen.spot.decode.unshown += 1
        log.warning(
            "a hop could not show its work: paid nothing for the generation",
            peer=peer,
            why=why[:200],
        )

    async def _check_shown(
        self,
        hops: tuple[Hop, ...],
        hop: Hop,
        j: int,
        kind: str = "decode",
        counts: Counts | None = None,
    ) -> None:
        """Have `hop` show its steps up to the j-th of the route, and judge the j-th (a
        check of `kind`, counted in `counts`: the decode checks' unless given)."""
        k = hops.index(hop)
        shown = await self._shown(hop, k, j)
        if shown is None:
            return
        done = self.done[j]
        what = "decode steps" if len(done.ids) == 1 or done.verify else "prompt chunks"
        unit = f"{unit_name(hop)} ({what})"
        out: Output = (
            tuple(TokenEvent(t) for t in done.tokens)
            if hop.head
            else tensors.widen(shown[j].out, "shown.out")
        )
        x = np.concatenate([s.x for s in shown]).astype(
            np.float32 if shown[0].dt != "i32" else np.int32
        )
        await self._judge(
            kind,
            counts if counts is not None else self.gen.spot.decode,
            hop,
            unit,
            x,
            out,
            lambda pieces: self._rebuild(pieces, shown),
        )

    async def _shown(self, hop: Hop, k: int, j: int) -> tuple[Shown, ...] | None:
        """Steps 0..j of hop k's session as it shows them, each the step the route computed
        and with the digests it committed to; None (the hop unshown) otherwise."""
        got: list[Shown] = []
        try:
            while len(got) <= j:
                more = _read(
                    hop.peer,
                    Revealed.from_wire,
                    await self._call(hop, Reveal(f"{self.sid}.{k}", len(got), j)),
                ).steps
                if not more:
                    raise HopFailed(hop.peer, "showed no steps")
                got += more
        except HopFailed as exc:
            self._unshown(hop.peer, f"did not show its steps: {exc.reason}")
            return None
        commit = self.commits[k]
        for step, (shown, done) in enumerate(zip(got[: j + 1], self.done, strict=False)):
            at = step * STEP_DIGESTS
            if (
                shown.start != done.start
                or len(shown.x) != len(done.ids)
                or (shown.singly, shown.verify) != (done.singly, done.verify)
            ):
                why = f"showed step {step} other than the route computed it"
            elif (
                digest(shown.x, shown.dt) + digest(shown.out, shown.out_dt)
                != commit[at : at + STEP_DIGESTS]
            ):
                why = f"showed rows of step {step} other than those it committed to"
            else:
                continue
            self._unshown(hop.peer, why)
            return None
        return tuple(got[: j + 1])

    async def _rebuild(self, pieces: tuple[Hop, ...], shown: tuple[Shown, ...]) -> Output:
        """What `pieces` compute for the last of `shown` after the steps before it, given
        the inputs the checked hop showed, in throwaway sessions: the prompt chunks as they
        were, consecutive decode steps as one step computed a position at a time (as they
        first were), speculative steps as they were (positions past a rejected guess are
        dropped when the next step starts before them), the head drawing from the seeded
        stream where the route's head drew for that step; the work is counted to the
        pieces like any hop's."""
        plan: list[tuple[int, np.ndarray, str, bool, bool]] = []
        for s in shown:
            last = plan[-1] if plan else None
            if (
                last is not None
                and len(s.x) == 1
                and last[3]
                and not last[4]
                and not s.verify
                and last[0] + len(last[1]) == s.start
            ):
                plan[-1] = (last[0], np.concatenate([last[1], s.x]), last[2], True, False)
            else:
                plan.append((s.start, s.x, s.dt, len(s.x) == 1 or s.singly, s.verify))
        draws, prompt = self.opened
        draws += len(shown) - len(plan)  # a merged step draws once, where the route drew a step
        gen, sid = self.gen, secrets.token_hex(8)
        end = max(start + len(x) for start, x, *_ in plan)
        opened: list[int] = []
        try:
            for i, p in enumerate(pieces):
                _read(
                    p.peer,
                    Opened.from_wire,
                    await self._call(
                        p,
                        Open(
                            f"{sid}.{i}",
                            self.model,
                            p.first,
                            p.end,
                            p.embed,
                            p.head,
                            end,
                            MAX_TOP if p.head else 0,
                            "",
                            self.sampling,
                            draws,
                            prompt,
                            delegation=gen.issuer.issue(p.peer, life_s(end)) if gen.issuer else b"",
                        ),
                    ),
                )
                opened.append(i)
            for (start, x, dt, singly, verify), ids in zip(plan, self._plan_ids(plan), strict=True):
                out = await self._through(
                    pieces, sid, tensors.widen(x, "shown.x"), dt, ids, start, singly, verify
                )
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                for i in opened:
                    with contextlib.suppress(HopFailed):
                        await self._call(pieces[i], Close(f"{sid}.{i}"))
        n = sum(len(s.x) for s in shown)
        for p in pieces:
            self.units[p.peer] += n * (p.end - p.first + p.head)
        return out if isinstance(out, tuple) else out[-len(shown[-1].x) :]

    def _plan_ids(
        self, plan: list[tuple[int, np.ndarray, str, bool, bool]]
    ) -> Iterator[tuple[int, ...]]:
        """The token ids of each step of a rebuild's plan, as the route's steps sent them
        (a speculative step's guesses are not in the history)."""
        sent = {(d.start, len(d.ids)): d.ids for d in self.done}
        for start, x, *_ in plan:
            yield sent.get((start, len(x)), tuple(self.history[start : start + len(x)]))

    async def _chain(
        self, ids: tuple[int, ...], start: int, singly: bool = False, verify: bool = False
    ) -> Drawn:
        """One step forwarded hop to hop; the head's result comes back to our Inbox."""
        assert self.route is not None
        hops, me, riding = self.route.hops, self.gen.me, self.riding
        ticket = secrets.token_hex(8)
        traced = bool(riding) or len(ids) == 1 and self.steps % TRACE_EVERY == 0
        msg = Step(
            f"{self.sid}.0",
            start,
            np.asarray(ids),
            "i32",
            ids,
            Forward(
                ticket,
                tuple((h.peer, f"{self.sid}.{i}") for i, h in enumerate(hops) if i),
                me,
                () if traced else None,
                opens=tuple(riding[i] for i in range(1, len(hops))) if riding else (),
            ),
            singly,
            verify,
            riding.get(0),
        ).to_wire()
        began, sent = time.perf_counter(), time.monotonic()
        with self.gen.inbox.expect(ticket, {me, *self.route.peers}) as results:
            if hops[0].peer == me:
                await self._local(msg)
            else:
                await self.gen.channels.notify(
                    hops[0].peer, STAGE_PROTOCOL, msg, self.gen.config.step_timeout_s
                )
            arrival = await self._await_result(results, start + len(ids))
        self.progress.step_ms = round((time.perf_counter() - began) * 1000, 2)
        self.riding = {}
        result = arrival.result
        if isinstance(result, Failure):
            raise await self._blame(arrival.sender, result)
        if traced:
            stamps = [list(h) for h in result.trace] if result.trace is not None else None
            (self.gen.first_traces if riding else self.gen.traces).add(
                StepTrace.parse(self.route.peers, sent, arrival.at, stamps, self.answered)
            )
        self.answered = arrival.at
        return result.tokens

    async def _await_result(self, results: trio.MemoryReceiveChannel[Arrival], end: int) -> Arrival:
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
            raise HopFailed(
                hops[lagging].peer,
                f"no result within {self.gen.config.step_timeout_s:g} s (position {end - 1})",
            )

    async def _ping(self, i: int) -> Pong:
        """Hop i's session: the positions it computed, or HopFailed when the hop does not
        answer in time (one computing a step in place answers only after it, so the time
        scales with the route's steps). A hop that is silent (nothing broke) gets a
        second ping with twice the time: a node starved for a second by its machine
        is not taken for a hung one (which still fails within ~3 s)."""
        assert self.route is not None
        peer, msg = self.route.hops[i].peer, Ping(f"{self.sid}.{i}").to_wire()
        if peer == self.gen.me:
            reply = await self._local(msg)
        else:
            wait_s = max(PROBE_TIMEOUT_S, 3 * self.progress.step_ms / 1000)
            try:
                reply = await self.gen.channels.request(peer, STAGE_PROTOCOL, msg, wait_s)
            except Silent:
                reply = await self.gen.channels.request(peer, STAGE_PROTOCOL, msg, 2 * wait_s)
        return _read(peer, Pong.from_wire, reply)

    async def _probe(self, end: int) -> tuple[int, str]:
        """Ping every hop: (index, why) of the first that does not answer, else (index, "")
        of the first that has not computed up to `end`, else (-1, "")."""
        assert self.route is not None
        first_behind = -1
        for i, hop in enumerate(self.route.hops):
            try:
                at = (await self._ping(i)).at
            except Refused as exc:
                if exc.code != "gone" or i not in self.riding:
                    return i, f"stopped answering during a step ({exc.reason})"
                at = -1  # its session opens with the step, which has not reached it
            except HopFailed as exc:
                if hop.peer != self.gen.me:
                    return i, f"stopped answering during a step ({exc.reason})"
                at = -1
            if first_behind < 0 and at < end:
                first_behind = i
        return first_behind, ""

    async def _blame(self, reporter: str, failure: Failure) -> HopFailed:
        """The failure a chain reported, pinned on a peer we checked ourselves.

        A hop reporting its own refusal is taken at its word. A hop saying a peer sent it
        NaN or infinite rows ("broken") is weighed by failover.Accusations when that peer
        is the hop before it on the route, else it is the failed hop. A hop saying it
        could not reach the next one is believed only if the next one does not answer us
        either; otherwise the reporter (or its link) is the broken part.
        """
        accused, code, detail = failure.peer, failure.code, failure.error
        if accused in ("", reporter):
            return Refused(reporter, code, detail)
        assert self.route is not None
        if code == "broken":
            hops = self.route.hops
            if not any(
                a.peer == accused and b.peer == reporter for a, b in itertools.pairwise(hops)
            ):
                return HopFailed(reporter, f"accused a peer that sent it nothing: {detail}")
            return self.gen.accusations.weigh(reporter, accused, detail)
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

    async def _call(self, hop: Hop, message: Open | Step | Close | Reveal) -> dict[str, Any]:
        """A request to one hop; its reply as it came (a step's is timed)."""
        began = time.perf_counter()
        if hop.peer == self.gen.me:
            reply = await self._local(message.to_wire())
        else:
            timeout = self.gen.config.step_timeout_s
            reply = await self.gen.channels.request(
                hop.peer, STAGE_PROTOCOL, message.to_wire(), timeout
            )
        ms = (time.perf_counter() - began) * 1000
        if isinstance(message, Step) and len(message.x) == 1:  # a decode step's time
            self.progress.hop_ms[hop.peer] = round(ms, 2)
            # the route's own steps only: a spot check's recomputation would make its
            # checkers look slower than the peers never measured (heartbeat round trips),
            # and routing would keep to the ones it checks
            if hop.peer != self.gen.me and message.sid.startswith(f"{self.sid}."):
                self.gen.latency.observe(hop.peer, ms)
        return reply

    async def _local(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A message to this node's own stage server, a direct call: its refusal reads as
        any hop's, a Refused naming us."""
        try:
            return await self.gen.local(self.gen.me, msg)
        except Refusal as exc:
            raise Refused(self.gen.me, exc.code, exc.detail) from None
        except WireError as exc:  # as a peer's transport answers a frame it cannot read
            raise Refused(self.gen.me, "bad", str(exc)) from None

    async def close(self) -> None:
        """Close the route's sessions; with prefix reuse on, each hop keeps the full pages
        it computed, and this node remembers the route as where they are."""
        if self.route is None:
            return
        route, self.route = self.route, None
        keys = page_keys(self.history) if self.gen.config.prefix_cache else b""

        async def close(i: int, hop: Hop) -> None:
            with contextlib.suppress(HopFailed):
                reply = await self._call(
                    hop, Close(f"{self.sid}.{i}", hop_keys(keys, route, i) if keys else b"")
                )
                closed = _read(hop.peer, Closed.from_wire, reply)
                self._count_experts(hop, i, closed)
                self.commits[i] = closed.steps

        # side by side: a hop's commitment is its pay (check_decode), so a busy hop gets
        # CLOSE_S to answer, and a dead one costs that once, not once a hop
        with trio.move_on_after(CLOSE_S):
            async with trio.open_nursery() as nursery:
                for i, hop in enumerate(route.hops):
                    nursery.start_soon(close, i, hop)
        if keys:
            self.gen.prefixes.remember(keys, route)


T = TypeVar("T")


def _read(peer: str, read: Callable[[dict[str, Any]], T], reply: dict[str, Any]) -> T:
    """A hop's reply as its type; a malformed one is the hop's failure."""
    try:
        return read(reply)
    except WireError as exc:
        raise HopFailed(peer, f"a malformed answer: {exc}") from None


def _head_reply(reply: dict[str, Any]) -> Drawn:
    return tokens_from_wire(reply, "reply")
