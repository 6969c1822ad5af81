"""StageServer: sessions on this node's stages, and the "/kvasir/stage/1" handler.

open (a session on [first, end) with embed/head), step (token ids or hidden rows at
positions start.. ─▶ hidden rows, or the sampled token at the last stage), close, ping.
Sessions are keyed by (caller, session id), bounded in number and KV room (admission
refuses with "busy" and a reason), and closed when idle. A forwarded step computes and
hands its output to the next hop itself, or its result to the session's owner; a failure
on the way names the peer that failed (kvasird.inference.protocol draws the messages).

A step on a stage that dispatches experts runs as steps on the event loop, so the decode
steps of concurrent sessions interleave (see _run_chain); the step's context
(kvasird.inference.stepcontext) tells the expert dispatcher whose session it computes.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from kvasird.compute.errors import ComputeError, KVCacheFull
from kvasird.compute.experts import ExpertShard, ExpertWorker, dispatch_steps
from kvasird.compute.kvcache import PAGE, Session
from kvasird.compute.sampling import Sampler, SamplingParams, log_softmax
from kvasird.compute.stage import Stage, held_now, locks_now
from kvasird.compute.steps import drive_async
from kvasird.errors import KvasirError, WireError
from kvasird.inference.errors import HopFailed, NoWorkers, Refused, Unreachable
from kvasird.inference.protocol import tensors
from kvasird.inference.server.engine import INLINE_TOKENS, Served, run_short
from kvasird.inference.stepcontext import COMPANY, TALLY, Company, Tally
from kvasird.inference.steptrace import collecting_waits, waiting
from kvasird.logs import get_logger
from kvasird.wire import schema

log = get_logger("kvasird.inference.server")

STAGE_POLL_S = (0.0005, 0.008)
"""A decode step waiting for a stage a prefill holds looks again after the first delay,
doubling up to the second (a long prefill must not cost its waiters' CPU in wake-ups)."""
MAX_TOP = 20
MAX_TRACE = 64
"""Hops a traced step records (a longer trace is dropped, the step goes on)."""


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
    used: float = field(default_factory=time.monotonic)
    """Last use, for idle expiry."""
    last_step: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """When the last step's compute began and ended (time.monotonic), and how long of it
    went to waiting for remote experts (s)."""
    tally: Tally = field(default_factory=lambda: Tally(""))
    """Whose session it is, and the expert work done for it on other peers."""

    def close(self) -> None:
        for s in self.sessions:
            s.close()



Admit = Callable[[str], Awaitable[None]]
"""(gateway peer) -> returns if this node works for that gateway now, else Refused."""


async def _admit_all(gateway: str) -> None:
    return None


Send = Callable[[str, dict[str, Any]], Awaitable[None]]
"""(peer, message) -> sent one-way on the stage protocol (HopFailed when it cannot be)."""
Deliver = Callable[[str, dict[str, Any]], None]
"""(sender, result message) -> handed to the generation waiting for it."""


async def _cannot_send(peer: str, msg: dict[str, Any]) -> None:
    raise HopFailed(peer, "this stage server forwards to no one (not linked to a node)")


class StageServer:
    """Sessions on this node's stages, and the stage protocol's request handler."""

    def __init__(self, model_id: Callable[[], str], served: Callable[[], Served | None], *,
                 max_sessions: int, idle_s: float, wire_dtype: str, me: str = "",
                 send: Send = _cannot_send, deliver: Deliver | None = None,
                 admit: Admit = _admit_all) -> None:
        self.model_id, self.served, self.admit = model_id, served, admit
        self.max_sessions, self.idle_s, self.wire_dtype = max_sessions, idle_s, wire_dtype
        self.me, self.send, self.deliver = me, send, deliver
        self.sessions: dict[tuple[str, str], ServedSession] = {}
        self._ended = trio.Event()
        self.tokens = 0
        """Token positions computed since the last load report."""
        self.forwarded = 0
        """Steps whose output this node forwarded to the next hop or returned to its owner."""
        self.company = Company()
        """Decode steps interleaved on this node's stages now (for the expert dispatcher)."""

    async def handle(self, caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "open":
            await self.admit(caller)
            return self._open(caller, msg)
        if op == "result":
            if self.deliver is None:
                raise WireError("stage: this node is waiting for no results")
            self.deliver(caller, msg)
            return {}
        if op == "step" and "back" in msg:
            await self._forwarded(caller, msg)
            return {}
        key = (caller, schema.text(msg, "sid", 64, "stage"))
        if op == "close":
            s = self.sessions.get(key)
            self._end([key])
            return {"experts": dict(s.tally.experts)} if s is not None and s.tally.experts \
                else {}
        if op == "ping":
            return {"at": self._session(key).at}
        if op == "step":
            return await self._step(self._session(key), msg)
        raise WireError(f"stage: unknown op {op!r}")

    def inline(self, msg: dict[str, Any]) -> bool:
        """Whether a one-way message may be handled in its stream's reader task: a
        forwarded decode step on a node that dispatches no experts, while nothing else
        computes here, so that it computes in place (holding the event loop anyway) and
        hands its output on; a result for this node. Saves a task start and a pass through
        the scheduler per hop (the ring's queue per hop 0.21-0.23 -> 0.09-0.13 ms)."""
        if msg.get("op") == "result":
            return True
        if msg.get("op") != "step" or "back" not in msg:
            return False
        served, x = self.served(), msg.get("x")
        shape = x.get("shape") if isinstance(x, dict) else None
        if (served is None or served.dispatches or not isinstance(shape, list) or not shape
                or not isinstance(shape[0], int) or shape[0] > INLINE_TOKENS):
            return False
        with held_now([served.backend]) as free:  # else the reader would wait for a thread
            return free

    def _session(self, key: tuple[str, str]) -> ServedSession:
        s = self.sessions.get(key)
        if s is None:
            raise Refused("", "gone", "no such session (expired, or this node restarted)")
        return s

    async def _forwarded(self, caller: str, msg: dict[str, Any]) -> None:
        """A step of a forwarded chain: compute, then pass the output on (or back home)."""
        owner = schema.text(msg, "owner", 128, "stage") if "owner" in msg else caller
        ticket = schema.text(schema.mapping(msg["back"], "stage.back"), "ticket", 64,
                             "stage.back")
        culprit = self.me
        try:
            chain = [_hop_ref(h) for h in schema.items(msg, "next", 64, "stage")]
            s = self._session((owner, schema.text(msg, "sid", 64, "stage")))
            if caller not in (owner, s.prev):
                raise Refused("", "bad", "only the session's owner and the hop before it on "
                                         "the route may step it")
            reply = await self._step(s, msg)
            if chain and "x" not in reply:
                raise Refused("", "bad", "the route goes on after the head: the head hop "
                                         "must be the last")
            if not chain and "x" in reply:
                raise Refused("", "bad", "the route ends before the head")
            culprit = chain[0][0] if chain else owner
            if chain:
                out = {"op": "step", "sid": chain[0][1], "start": msg["start"], "x": reply["x"],
                       "ids": msg.get("ids"), "owner": owner, "next": [list(h) for h in chain[1:]],
                       "back": {"ticket": ticket}}
                if (trace := _traced(msg, s)) is not None:
                    out["trace"] = trace
                await self.send(chain[0][0], out)
            else:
                result = {"op": "result", "ticket": ticket, **reply}
                if (trace := _traced(msg, s)) is not None:
                    result["trace"] = trace
                await self.send(owner, result)
            self.forwarded += 1
        except KvasirError as exc:  # Refused, HopFailed (forwarding), WireError
            code, detail = ((exc.code, exc.detail) if isinstance(exc, Refused)
                            else ("unreachable", exc.reason) if isinstance(exc, Unreachable)
                            else ("gone", exc.reason) if isinstance(exc, HopFailed)
                            else ("bad", str(exc)))
            if culprit == owner:
                log.debug("result not delivered", owner=owner, reason=detail[:200])
                return
            with contextlib.suppress(HopFailed):
                await self.send(owner, {"op": "result", "ticket": ticket, "error": detail[:500],
                                        "code": code, "peer": culprit})

    def _open(self, caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        served = self.served()
        if served is None or schema.text(msg, "model", 64, "stage") != self.model_id():
            raise Refused("", "bad", "this node serves no stage of that model")
        sid = schema.text(msg, "sid", 64, "stage")
        n = served.hp.n_layer
        first = schema.integer(msg, "first", 0, n, "stage")
        end = schema.integer(msg, "end", first, n, "stage")
        max_tokens = schema.integer(msg, "max_tokens", 1, 1 << 22, "stage")
        chain = served.stages_for(first, end, bool(msg.get("embed")), bool(msg.get("head")))
        self.expire()
        if len(self.sessions) >= self.max_sessions and (caller, sid) not in self.sessions:
            raise Refused("", "busy", f"serving {len(self.sessions)} sessions, the limit")
        need = -(-max_tokens // PAGE) * PAGE
        for stage in chain:
            if stage.kv.max_session_tokens < max_tokens or stage.kv.free_tokens < need:
                raise Refused("", "busy", f"KV cache has {stage.kv.free_tokens} free slots, "
                                          f"the session needs {need}")
        sampler = None
        if msg.get("head"):
            params = _sampling(schema.mapping(msg.get("sampling"), "stage.sampling"))
            sampler = Sampler(params)
            if params.temperature > 0:  # a replay continues the seeded stream where it was
                for _ in range(schema.integer(msg, "draws", 0, 1 << 22, "stage")):
                    sampler(np.zeros(2))
        prev = schema.text(msg, "prev", 128, "stage") if "prev" in msg else ""
        self._end([(caller, sid)])
        self.sessions[(caller, sid)] = ServedSession(
            chain, [st.open_session() for st in chain], sampler,
            schema.integer(msg, "logprobs", 0, MAX_TOP, "stage"), max_tokens, prev,
            tally=Tally(caller))
        return {}

    async def _step(self, s: ServedSession, msg: dict[str, Any]) -> dict[str, Any]:
        start = schema.integer(msg, "start", 0, s.max_tokens, "stage")
        first = s.chain[0]
        if first.embed:
            x = tensors.decode(msg.get("x"), "stage.x", ("i32",), (None,))
        else:
            x = tensors.decode(msg.get("x"), "stage.x", ("f32", "f16"), (None, first.hp.n_embd))
        if start + len(x) > s.max_tokens:
            raise Refused("", "bad", f"positions up to {start + len(x)} exceed the session's "
                                     f"{s.max_tokens}")
        if s.sampler is not None:
            ids = msg.get("ids")
            if (not isinstance(ids, list) or len(ids) != len(x)
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise WireError("stage.ids: expected the token ids of the positions sent")
            del s.history[start:]
            s.history += ids
        s.used = began = time.monotonic()
        try:
            with collecting_waits() as waited:
                out = await _run_chain(s, x, start, self.company)
        except (KVCacheFull, NoWorkers) as exc:
            raise Refused("", "busy", str(exc)) from None
        except ComputeError as exc:
            raise Refused("", "bad", str(exc)) from None
        finally:
            s.used = time.monotonic()
            s.last_step = (began, s.used, waited[0])
        self.tokens += len(x)
        s.at = start + len(x)
        if s.sampler is None:
            return {"x": tensors.encode(out, self.wire_dtype)}
        token = s.sampler(out[-1], s.history)
        reply: dict[str, Any] = {"token": token}
        if s.logprobs:
            lp = log_softmax(out[-1])
            top = np.argsort(-lp, kind="stable")[:s.logprobs]
            reply.update(logprob=float(lp[token]), top=[[int(i), float(lp[i])] for i in top])
        return reply

    def expire(self) -> None:
        now = time.monotonic()
        self._end([k for k, s in self.sessions.items() if now - s.used > self.idle_s])

    def close_all(self) -> None:
        self._end(list(self.sessions))

    def _end(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            if (s := self.sessions.pop(key, None)) is not None:
                s.close()
        self._ended.set()
        self._ended = trio.Event()

    async def wait_unused(self, stages: list[Stage]) -> None:
        """Return once no session runs on any of `stages` (they close or expire)."""
        while any(st in stages for s in self.sessions.values() for st in s.chain):
            await self._ended.wait()


async def _run_chain(s: ServedSession, x: np.ndarray, start: int,
                     company: Company) -> np.ndarray:
    """A step through the hop's stages: in place when short and nothing else computes on
    them, else in a worker thread. A short step on a stage that dispatches experts runs as
    steps (compute.steps) on the event loop, awaiting the remote experts of each MoE layer
    while holding only the stages' own locks (reentrant: the loop thread's), so the decode
    steps of concurrent sessions interleave: one computes while others wait for their
    experts, and their rows reach the workers together (one message per worker and layer,
    ExpertDispatcher.remote). While a prefill in a worker thread holds a stage, decode
    steps wait for it on the loop."""
    short = len(x) <= INLINE_TOKENS
    if not any(st.dispatches for st in s.chain):
        return await run_short(s.chain, short, _run_chain_now, s, x, start)
    tally = TALLY.set(s.tally)
    try:
        if not short:  # the thread and its expert calls run in this context
            return await trio.to_thread.run_sync(_run_chain_now, s, x, start)
        return await _run_chain_steps(s, x, start, company)
    finally:
        TALLY.reset(tally)


async def _run_chain_steps(s: ServedSession, x: np.ndarray, start: int,
                           company: Company) -> np.ndarray:
    """A short step as steps on the event loop (see _run_chain)."""
    delay = STAGE_POLL_S[0]
    while True:
        with locks_now(st.own_lock for st in s.chain) as held:
            if held and not any(st.queued for st in s.chain):
                company.now += 1
                token = COMPANY.set(company)
                try:
                    for stage, session in zip(s.chain, s.sessions, strict=True):
                        x = await drive_async(stage.forward_steps(session, x, start),
                                              functools.partial(_serve_async, stage))
                finally:
                    company.now -= 1
                    COMPANY.reset(token)
                return x
        # A forward in a worker thread (a prefill) holds a stage or waits for it: wait for
        # it here rather than in a thread of our own, which would hold the stage in turn
        # through its remote waits and send every later step to a thread the same way (a
        # convoy: with 16 sessions no step ran on the loop any more, and none overlapped);
        # and start no step meanwhile, or steps in flight could hold it for ever.
        await trio.sleep(delay)
        delay = min(2 * delay, STAGE_POLL_S[1])


def _run_chain_now(s: ServedSession, x: np.ndarray, start: int) -> np.ndarray:
    for stage, session in zip(s.chain, s.sessions, strict=True):
        x = stage.forward(session, x, start)
    return x


async def _serve_async(stage: Stage, need: tuple[Any, ...]) -> Any:
    """A need of a forward run on the event loop: a graph in place (in a thread if another
    computation holds the backend), expert outputs from each shard (remote ones awaited)."""
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

    return await drive_async(dispatch_steps(layer, cur, ids, stage.shards[layer]), shard_outputs)


def _traced(msg: dict[str, Any], s: ServedSession) -> list[list[float]] | None:
    """A traced step's stamps so far plus this hop's, as its output is handed on:
    [received, compute began, compute ended, handed on, experts waited]; None when the
    step is not traced.

    `rx` is stamped by `channel.serve` when the frame was read (a step from this node
    itself has none: it was received when it was handed over)."""
    trace = msg.get("trace")
    if not isinstance(trace, list) or len(trace) >= MAX_TRACE:
        return None
    rx = msg.get("rx")
    began, ended, experts = s.last_step
    return [*trace, [rx if isinstance(rx, float) else began, began, ended, time.monotonic(),
                     experts]]


def _hop_ref(value: Any) -> tuple[str, str]:
    """One entry of a forwarded step's `next`: [peer id, session id]."""
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, str) for v in value)
            or len(value[0]) > 128 or len(value[1]) > 64):
        raise WireError("stage.next: expected [peer id, session id] pairs")
    return value[0], value[1]


def _sampling(d: dict[str, Any]) -> SamplingParams:
    seed = d.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise WireError("stage.sampling.seed: expected an integer or nil")
    try:
        return SamplingParams(
            temperature=schema.number(d, "temperature", 0, 1e6, "stage.sampling"),
            top_k=schema.integer(d, "top_k", 0, 1 << 24, "stage.sampling"),
            top_p=schema.number(d, "top_p", 0, 1, "stage.sampling"),
            repetition_penalty=schema.number(d, "repetition_penalty", 1e-6, 1e6, "stage.sampling"),
            seed=seed)
    except ComputeError as exc:
        raise WireError(f"stage.sampling: {exc}") from None

