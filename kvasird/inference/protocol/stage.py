"""The stage protocol's messages ("/kvasir/stage/1"), each a frozen type with its wire form.

``parse`` turns a decoded frame into one of Open, Step, Close, Ping, Reveal, Result or
Failure, or
raises WireError naming the field; the stage server's handlers see nothing else. Bounds
that depend on what a node serves (its layer count, n_embd, a session's room) are the
handler's to check; everything a message can be checked for on its own is checked here.
The replies the client reads are typed the same way: Hidden or a TokenEvent (a step),
Pong (a ping), Closed (a close), Revealed (a reveal). The keys and values are those the package
docstring draws, so nodes of either side of this change interoperate.

Sampling settings travel as one map, the wire form of compute's SamplingParams (the one
sampling type from the gateway to the head's sampler):

    {temperature, top_k, top_p, repetition_penalty, seed, min_p?, frequency_penalty?,
     presence_penalty?, penalty_last_n?, logit_bias?: [[token, value], ...], grammar?}

(a key marked ? is sent only where it differs from the default).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvasird.compute.errors import ComputeError
from kvasird.compute.kv.keys import KEY_BYTES, PAGE
from kvasird.compute.sampling import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_PENALTY_LAST_N,
    PENALTY_LAST_N,
    SamplingParams,
)
from kvasird.errors import WireError
from kvasird.inference.api import TokenEvent
from kvasird.inference.errors import Code, code_of
from kvasird.inference.protocol import MAX_LAYERS, delegation, tensors
from kvasird.wire import schema

MAX_POSITIONS = 1 << 22
"""Most positions a session may hold (prompt + completion)."""
MAX_TOP = 20
"""Most alternatives a head reports per token."""
MAX_TRACE = 64
"""Hops a traced step records (a longer trace is dropped, the step goes on)."""
MAX_ROUTE = 64
"""Most hops a forwarded step may still have ahead of it."""
MAX_TOKEN = (1 << 31) - 1
MAX_STAMPS = 8
"""Numbers one hop's trace entry may hold (five are used)."""
MAX_EXPERT_UNITS = 1 << 40
MAX_DRAFT = 64
"""Most tokens one speculative step may guess."""
MAX_STEPS = 1 << 16
"""Most steps of a session a hop commits to (Closed.steps) or shows (Revealed)."""
STEP_DIGESTS = 2 * tensors.DIGEST_BYTES
"""Bytes of one step's commitment: the digests of its input and of its output."""


@dataclass(frozen=True, slots=True)
class Open:
    """Open a session on the hop [first, end) of the model (with its embedding or head)."""

    sid: str
    """The caller's session id (a session is keyed by caller and sid)."""
    model: str
    """The model id the caller routes."""
    first: int
    """First layer of the hop's window."""
    end: int
    """End of the window (first == end: no layers, only the embedding or the head)."""
    embed: bool
    """The hop starts with the token embedding (its steps carry token ids)."""
    head: bool
    """The hop ends with the head: it samples, and answers steps with tokens."""
    max_tokens: int
    """Positions the session may reach (prompt + completion)."""
    logprobs: int = 0
    """Alternatives to report per token (0 = none; the head only)."""
    prev: str = ""
    """The peer that may forward steps into this session besides its owner ("" = none)."""
    sampling: SamplingParams = SamplingParams()
    """How the head samples (sent to every hop; required at the head)."""
    draws: int = 0
    """Draws a replay skips, so a seeded stream continues where the failed route stopped."""
    prompt: int = 0
    """Positions of the prompt: a grammar (sampling.grammar) constrains what follows them."""
    prefix: bytes = b""
    """The page keys of the prompt's full pages (kv.keys.page_keys): the hop starts the
    session from the longest run of them it kept and answers how far (Opened)."""
    delegation: bytes = b""
    """The caller's signed delegation to this hop (protocol.delegation), which the hop sends
    with the session's expert requests; a hop that dispatches experts needs one."""
    embeddings: bool = False
    """An embedding session: the head samples nothing and answers each step with every
    position's hidden state after the final norm (Hidden), which the caller pools.
    Optional on the wire."""

    def to_wire(self) -> dict[str, Any]:
        out = {
            "op": "open",
            "sid": self.sid,
            "model": self.model,
            "first": self.first,
            "end": self.end,
            "embed": self.embed,
            "head": self.head,
            "max_tokens": self.max_tokens,
            "sampling": sampling_to_wire(self.sampling),
            "logprobs": self.logprobs,
            "draws": self.draws,
            "prev": self.prev,
        }
        if self.prefix:
            out["prefix"] = self.prefix
        if self.delegation:
            out["delegation"] = self.delegation
        if self.embeddings:
            out["embeddings"] = True
        return {**out, "prompt": self.prompt} if self.prompt else out

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Open:
        first = schema.integer(d, "first", 0, MAX_LAYERS, "stage")
        head = _boolean(d, "head", "stage")
        sampling = (
            sampling_from_wire(d.get("sampling"), "stage.sampling")
            if head or "sampling" in d
            else SamplingParams()
        )
        # a replay of a sampled stream must say how far it was drawn; greedy ones draw nothing
        draws = (
            schema.integer(d, "draws", 0, MAX_POSITIONS, "stage")
            if "draws" in d or (head and sampling.temperature > 0)
            else 0
        )
        max_tokens = schema.integer(d, "max_tokens", 1, MAX_POSITIONS, "stage")
        return Open(
            schema.text(d, "sid", 64, "stage"),
            schema.text(d, "model", 64, "stage"),
            first,
            schema.integer(d, "end", first, MAX_LAYERS, "stage"),
            _boolean(d, "embed", "stage"),
            head,
            max_tokens,
            schema.integer(d, "logprobs", 0, MAX_TOP, "stage"),
            schema.text(d, "prev", 128, "stage") if "prev" in d else "",
            sampling,
            draws,
            schema.integer(d, "prompt", 0, MAX_POSITIONS, "stage") if "prompt" in d else 0,
            _keys(d, "prefix", max_tokens),
            _delegation(d),
            "embeddings" in d and _boolean(d, "embeddings", "stage"),
        )


@dataclass(frozen=True, slots=True)
class Forward:
    """What makes a step forwarded: nobody waits for its answer; the hop sends its output
    on to the next hop, or (the last) the token to the owner as a Result."""

    ticket: str
    """The owner's ticket for the result (the wire's ``back: {ticket}``)."""
    next_hops: tuple[tuple[str, str], ...]
    """(peer, session id) of each hop still ahead (the wire's ``next``)."""
    owner: str | None = None
    """The gateway whose session it is (None: the caller, which sent it first)."""
    trace: tuple[tuple[float, ...], ...] | None = None
    """The stamps of the hops so far, when the step is traced (steptrace)."""
    rx: float | None = None
    """When this node read the frame (time.monotonic), stamped by channel.serve for a
    traced step; not a wire field."""
    opens: tuple[Open, ...] = ()
    """The Opens of the hops ahead (the first ones of ``next_hops``) whose sessions open
    with this step (Step.open): each hop hands the next its own and the rest."""

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Forward:
        back = schema.mapping(d.get("back"), "stage.back")
        hops = schema.items(d, "next", MAX_ROUTE, "stage")
        for h in hops:  # a loop, not all(): this runs for every hop of every token
            if (
                type(h) is not list
                or len(h) != 2
                or type(h[0]) is not str
                or type(h[1]) is not str
                or len(h[0]) > 128
                or len(h[1]) > 64
            ):
                raise WireError("stage.next: expected [peer id, session id] pairs")
        trace = _trace(d["trace"], MAX_TRACE - 1) if "trace" in d else None
        rx = d.get("rx") if trace is not None else None
        opens = schema.items(d, "opens", len(hops), "stage") if "opens" in d else ()
        return Forward(
            schema.text(back, "ticket", 64, "stage.back"),
            tuple(map(tuple, hops)),
            schema.text(d, "owner", 128, "stage") if "owner" in d else None,
            trace,
            rx if isinstance(rx, float) else None,
            tuple(Open.from_wire(schema.mapping(o, "stage.opens")) for o in opens),
        )


@dataclass(frozen=True, slots=True, eq=False)
class Step:
    """Positions start.. through a session: token ids at a hop that embeds, else the
    previous hop's hidden rows. Answered with Hidden, or a TokenEvent at the head."""

    sid: str
    start: int
    """Position of the first row."""
    x: np.ndarray
    """Token ids (int32 [T]) or hidden rows (float32 [T, n_embd]). As received: the values
    as they travelled (a view of the frame, f16 included, unchecked) until ``widened``,
    which the server calls once it knows the session; on a forwarded step NaN or infinity
    pass, for the stage to refuse naming the hop that sent them (read strictly, the frame
    would be dropped and nobody told why)."""
    dt: str = "i32"
    """How x travels: "i32" for ids, "f32" or "f16" for rows."""
    ids: tuple[int, ...] | None = None
    """The T token ids (the head's repetition penalty needs them; absent before the head
    on a relayed step)."""
    forward: Forward | None = None
    """Present on a forwarded step."""
    singly: bool = False
    """Compute the T positions one at a time, as the decode steps they first were: what an
    exact replay after a failover sends for the generated tokens (a batch of T rounds
    differently from T steps of one). The head samples once, after the last. Optional on
    the wire; an older node computes them as one batch."""
    verify: bool = False
    """A speculative step (kvasird.inference.client.speculate): ids[1:] are tokens guessed
    to follow ids[0]. With ``singly`` every hop computes the positions one at a time (each
    row holds the bits a decode step of it would: greedy output is the undrafted output
    token for token), else as one batch (rows equal to float rounding); the head draws
    after each position, from its seeded stream as a decode step would, and stops at the
    first draw that differs from the next guess (or after the last position). It answers
    every token drawn, in order: the guesses accepted, then its own. The next step starts
    after the last token drawn, and every hop forgets the positions past it (KV
    truncation). Optional on the wire."""
    open: Open | None = None
    """The Open of the session this step is for, when it opens with the step: the hop
    opens it first (the owner's delegation to this hop must come with it), so a route
    whose links are long spends no round trip on opening before its first prompt chunk.
    Optional on the wire."""
    part: tuple[int, int] | None = None
    """(j, n): this message carries row j (position start + j) of a forwarded speculative
    step of n rows computed singly, sent on by the hop before as soon as it computed that
    row, so the hops of a route compute a check's rows side by side instead of one hop
    after another (server.stage: Parts). ``ids`` holds all n token ids. Optional on the
    wire; sent only by a hop to the next."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "op": "step",
            "sid": self.sid,
            "start": self.start,
            "x": tensors.encode(self.x, self.dt),
        }
        if self.ids is not None:
            out["ids"] = list(self.ids)
        if self.singly:
            out["singly"] = True
        if self.verify:
            out["verify"] = True
        if self.open is not None:
            out["open"] = self.open.to_wire()
        if self.part is not None:
            out["part"] = list(self.part)
        if (f := self.forward) is not None:
            if f.owner is not None:
                out["owner"] = f.owner
            out["back"] = {"ticket": f.ticket}
            out["next"] = [list(h) for h in f.next_hops]
            if f.opens:
                out["opens"] = [o.to_wire() for o in f.opens]
            if f.trace is not None:
                out["trace"] = [list(h) for h in f.trace]
        return out

    def widened(self) -> Step:
        """The step with its rows as float32 (tensors.widen: a copy, checked finite unless
        forwarded); token ids as they are."""
        return replace(self, x=tensors.widen(self.x, "stage.x", finite=self.forward is None))

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Step:
        x, dt = _viewed(d.get("x"), "stage.x")
        ids = d.get("ids")
        if "verify" in d and len(x) > MAX_DRAFT + 1:
            raise WireError(f"stage.x: a speculative step guesses at most {MAX_DRAFT} tokens")
        part = _part(d, len(x)) if "part" in d else None
        return Step(
            schema.text(d, "sid", 64, "stage"),
            schema.integer(d, "start", 0, MAX_POSITIONS, "stage"),
            x,
            dt,
            None if ids is None else _ids(ids, len(x) if part is None else part[1]),
            Forward.from_wire(d) if "back" in d else None,
            "singly" in d and _boolean(d, "singly", "stage"),
            "verify" in d and _boolean(d, "verify", "stage"),
            Open.from_wire(schema.mapping(d["open"], "stage.open")) if "open" in d else None,
            part,
        )


def _part(d: dict[str, Any], rows: int) -> tuple[int, int]:
    """A part's (j, n): one row of a forwarded speculative step computed singly."""
    v = d["part"]
    if (
        type(v) is not list
        or len(v) != 2
        or type(v[0]) is not int
        or type(v[1]) is not int
        or not 0 <= v[0] < v[1] <= MAX_DRAFT + 1
    ):
        raise WireError(f"stage.part: expected [row, rows] with 0 <= row < rows <= {MAX_DRAFT + 1}")
    if rows != 1 or "back" not in d or d.get("verify") is not True or d.get("singly") is not True:
        raise WireError(
            "stage.part: a part is one row of a forwarded speculative step computed singly"
        )
    return v[0], v[1]


@dataclass(frozen=True, slots=True)
class Close:
    """End a session; answered with Closed."""

    sid: str
    keep: bytes = b""
    """Page keys of the session's tokens (kv.keys.page_keys): the hop keeps that many of
    its full pages for later sessions of the same caller to start from."""

    def to_wire(self) -> dict[str, Any]:
        out = {"op": "close", "sid": self.sid}
        return {**out, "keep": self.keep} if self.keep else out

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Close:
        return Close(schema.text(d, "sid", 64, "stage"), _keys(d, "keep", MAX_POSITIONS))


@dataclass(frozen=True, slots=True)
class Ping:
    """How far a session has computed; answered with Pong."""

    sid: str

    def to_wire(self) -> dict[str, Any]:
        return {"op": "ping", "sid": self.sid}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Ping:
        return Ping(schema.text(d, "sid", 64, "stage"))


@dataclass(frozen=True, slots=True)
class Reveal:
    """Show steps first..last of a session (open, or closed lately) as they were computed;
    answered with Revealed. Only the session's owner may ask."""

    sid: str
    first: int
    last: int

    def to_wire(self) -> dict[str, Any]:
        return {"op": "reveal", "sid": self.sid, "first": self.first, "last": self.last}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Reveal:
        first = schema.integer(d, "first", 0, MAX_STEPS, "stage")
        return Reveal(
            schema.text(d, "sid", 64, "stage"),
            first,
            schema.integer(d, "last", first, MAX_STEPS, "stage"),
        )


@dataclass(frozen=True, slots=True)
class Result:
    """The tokens a forwarded chain's last hop drew (one, or a speculative step's
    several), sent one-way to the owner."""

    ticket: str
    tokens: tuple[TokenEvent, ...]
    trace: tuple[tuple[float, ...], ...] | None = None
    """Every hop's stamps, when the step was traced."""

    def to_wire(self) -> dict[str, Any]:
        out = {"op": "result", "ticket": self.ticket, **tokens_to_wire(self.tokens)}
        if self.trace is not None:
            out["trace"] = [list(h) for h in self.trace]
        return out

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Result:
        return Result(
            schema.text(d, "ticket", 64, "stage"),
            tokens_from_wire(d, "stage"),
            _trace(d["trace"], MAX_TRACE) if "trace" in d else None,
        )


@dataclass(frozen=True, slots=True)
class Failure:
    """A forwarded chain ended early: sent one-way to the owner, naming the peer that
    failed: the sender itself, the next hop it could not reach, or (code "broken") the hop
    before it, which sent it NaN or infinite hidden states."""

    ticket: str
    code: Code
    """A code outside the closed set reads as "bad"."""
    error: str
    peer: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "op": "result",
            "ticket": self.ticket,
            "error": self.error[:500],
            "code": self.code,
            "peer": self.peer,
        }

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Failure:
        return Failure(
            schema.text(d, "ticket", 64, "stage"),
            code_of(d.get("code")),
            schema.text(d, "error", 500, "stage"),
            schema.text(d, "peer", 128, "stage"),
        )


StageMessage = Open | Step | Close | Ping | Reveal | Result | Failure


def parse(msg: dict[str, Any]) -> StageMessage:
    """The message a decoded stage frame holds, validated (WireError naming the field)."""
    op = msg.get("op")
    if op == "step":  # the hot path first
        return Step.from_wire(msg)
    if op == "result":
        return Failure.from_wire(msg) if "error" in msg else Result.from_wire(msg)
    parser = _PARSERS.get(op) if isinstance(op, str) else None
    if parser is None:
        raise WireError(f"stage.op: unknown op {op!r:.40}")
    return parser(msg)


_PARSERS: dict[str, Callable[[dict[str, Any]], StageMessage]] = {
    "open": Open.from_wire,
    "close": Close.from_wire,
    "ping": Ping.from_wire,
    "reveal": Reveal.from_wire,
}


# --- replies ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Hidden:
    """A step's answer before the head: the hop's output rows, for the next hop."""

    x: np.ndarray
    """float32 [T, n_embd]."""
    dt: str
    """How the rows travel: "f32" or "f16"."""

    def to_wire(self) -> dict[str, Any]:
        return {"x": tensors.encode(self.x, self.dt)}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Hidden:
        x, dt = _rows(d.get("x"), "reply.x")
        if dt == "i32":
            raise WireError("reply.x.dt: expected hidden rows (f32 or f16), got token ids")
        return Hidden(x, dt)


@dataclass(frozen=True, slots=True)
class Opened:
    """An open's answer: the positions the session starts with (a kept prefix)."""

    cached: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"cached": self.cached} if self.cached else {}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Opened:
        return Opened(
            schema.integer(d, "cached", 0, MAX_POSITIONS, "reply") if "cached" in d else 0
        )


@dataclass(frozen=True, slots=True)
class Pong:
    """A ping's answer."""

    at: int
    """Positions the session has computed."""

    def to_wire(self) -> dict[str, Any]:
        return {"at": self.at}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Pong:
        return Pong(schema.integer(d, "at", 0, MAX_POSITIONS, "reply"))


@dataclass(frozen=True, slots=True)
class Closed:
    """A close's answer: the expert work done for the session on other peers, and the hop's
    commitment to every step it computed for it."""

    experts: tuple[tuple[str, int], ...] = ()
    """(worker peer, units: the experts its rows selected), as the stage counted them."""
    steps: bytes = b""
    """Per step, in the order computed: the digest of the input it received and of the
    output it sent (tensors.digest, 2 x DIGEST_BYTES). The owner compares each hop's
    outputs with the next hop's inputs, and a drawn hop must later show rows (Reveal)
    that have these digests: a hop is bound to what it computed before it learns what
    is checked."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"experts": dict(self.experts)} if self.experts else {}
        return {**out, "steps": self.steps} if self.steps else out

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Closed:
        steps = d.get("steps", b"")
        if (
            type(steps) is not bytes
            or len(steps) % STEP_DIGESTS
            or len(steps) > MAX_STEPS * STEP_DIGESTS
        ):
            raise WireError(
                f"reply.steps: expected at most {MAX_STEPS} steps' digests, "
                f"{STEP_DIGESTS} bytes each"
            )
        if "experts" not in d:
            return Closed(steps=steps)
        experts = schema.mapping(d["experts"], "reply.experts")
        if len(experts) > 4096 or not all(
            isinstance(p, str) and len(p) <= 128 and type(n) is int and 0 < n <= MAX_EXPERT_UNITS
            for p, n in experts.items()
        ):
            raise WireError("reply.experts: expected at most 4096 {peer id: units > 0}")
        return Closed(tuple(experts.items()), steps)


@dataclass(frozen=True, slots=True, eq=False)
class Shown:
    """One step of a session as its hop computed it, shown to the owner (Revealed)."""

    start: int
    """Position of its first row."""
    x: np.ndarray
    """What the hop received: token ids or hidden rows, as they travelled."""
    dt: str
    out: np.ndarray
    """What it sent: hidden rows as they travelled, or at the head the tokens drawn (i32)."""
    out_dt: str
    singly: bool = False
    """The step computed its positions one at a time (Step.singly)."""
    verify: bool = False
    """The step was speculative (Step.verify)."""

    def to_wire(self) -> dict[str, Any]:
        out = {
            "start": self.start,
            "x": tensors.encode(self.x, self.dt),
            "out": tensors.encode(self.out, self.out_dt),
        }
        if self.singly:
            out["singly"] = True
        if self.verify:
            out["verify"] = True
        return out

    @staticmethod
    def from_wire(d: Any) -> Shown:
        d = schema.mapping(d, "reply.shown")
        x, dt = _viewed(d.get("x"), "reply.shown.x")
        out, out_dt = _viewed(d.get("out"), "reply.shown.out")
        return Shown(
            schema.integer(d, "start", 0, MAX_POSITIONS, "reply.shown"),
            x,
            dt,
            out,
            out_dt,
            "singly" in d and _boolean(d, "singly", "reply.shown"),
            "verify" in d and _boolean(d, "verify", "reply.shown"),
        )


@dataclass(frozen=True, slots=True, eq=False)
class Revealed:
    """A reveal's answer: steps first.. of the session, as many as fit in a frame."""

    steps: tuple[Shown, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"steps": [s.to_wire() for s in self.steps]}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Revealed:
        return Revealed(
            tuple(Shown.from_wire(s) for s in schema.items(d, "steps", MAX_STEPS, "reply"))
        )


def tokens_to_wire(tokens: tuple[TokenEvent, ...]) -> dict[str, Any]:
    """The tokens a head drew for one step: the last as token_to_wire's map, those before
    it (a speculative step's accepted guesses) under "before"."""
    out = token_to_wire(tokens[-1])
    if len(tokens) > 1:
        out["before"] = [token_to_wire(t) for t in tokens[:-1]]
    return out


def tokens_from_wire(d: dict[str, Any], what: str) -> tuple[TokenEvent, ...]:
    before = schema.items(d, "before", MAX_DRAFT, what) if "before" in d else ()
    return (
        *(token_from_wire(schema.mapping(t, f"{what}.before"), f"{what}.before") for t in before),
        token_from_wire(d, what),
    )


def token_to_wire(t: TokenEvent) -> dict[str, Any]:
    """A head's sampled token: {token, logprob?, top?: [[token, logprob], ...]}."""
    if t.logprob is None:
        return {"token": t.token}
    return {"token": t.token, "logprob": t.logprob, "top": [list(p) for p in t.top]}


def token_from_wire(d: dict[str, Any], what: str) -> TokenEvent:
    token = schema.integer(d, "token", 0, MAX_TOKEN, what)
    if "logprob" not in d:
        return TokenEvent(token)
    top = schema.items(d, "top", MAX_TOP, what) if "top" in d else ()
    if not all(
        isinstance(t, list)
        and len(t) == 2
        and type(t[0]) is int
        and 0 <= t[0] <= MAX_TOKEN
        and type(t[1]) is float
        for t in top
    ):
        raise WireError(f"{what}.top: expected [token id, logprob] pairs")
    return TokenEvent(
        token,
        schema.number(d, "logprob", -sys.float_info.max, 1e-3, what),
        tuple((t[0], t[1]) for t in top),
    )


_OPTIONAL_SAMPLING = (
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "penalty_last_n",
    "logit_bias",
    "grammar",
)
"""Keys a sampling map holds only where they differ from the default: a map without them
(as nodes sent before these settings existed) means the defaults."""
_DEFAULT_SAMPLING = SamplingParams()


def sampling_to_wire(p: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "repetition_penalty": p.repetition_penalty,
        "seed": p.seed,
    }
    for key in _OPTIONAL_SAMPLING:
        value = getattr(p, key)
        if value != getattr(_DEFAULT_SAMPLING, key):
            # pairs as lists, as a decoded frame holds them: a route to this node skips the codec
            out[key] = [list(pair) for pair in value] if key == "logit_bias" else value
    return out


def sampling_from_wire(value: Any, what: str) -> SamplingParams:
    d = schema.mapping(value, what)
    seed = d.get("seed")
    if seed is not None and type(seed) is not int:
        raise WireError(f"{what}.seed: expected an integer or nil, got {seed!r:.40}")
    try:
        return SamplingParams(
            temperature=schema.number(d, "temperature", 0, 1e6, what),
            top_k=schema.integer(d, "top_k", 0, 1 << 24, what),
            top_p=schema.number(d, "top_p", 0, 1, what),
            min_p=schema.number(d, "min_p", 0, 1, what) if "min_p" in d else 0.0,
            repetition_penalty=schema.number(d, "repetition_penalty", 1e-6, 1e6, what),
            frequency_penalty=_penalty(d, "frequency_penalty", what),
            presence_penalty=_penalty(d, "presence_penalty", what),
            penalty_last_n=(
                schema.integer(d, "penalty_last_n", 0, MAX_PENALTY_LAST_N, what)
                if "penalty_last_n" in d
                else PENALTY_LAST_N
            ),
            logit_bias=_logit_bias(d, what),
            seed=seed,
            grammar=schema.text(d, "grammar", MAX_GRAMMAR_CHARS, what) if "grammar" in d else "",
        )
    except ComputeError as exc:  # a value the sampler refuses (top_p 0, a seed past 64 bits)
        raise WireError(f"{what}: {exc}") from None


def _penalty(d: dict[str, Any], key: str, what: str) -> float:
    return schema.number(d, key, -MAX_PENALTY, MAX_PENALTY, what) if key in d else 0.0


def _logit_bias(d: dict[str, Any], what: str) -> tuple[tuple[int, float], ...]:
    """[[token id, value], ...]; the values' range and repeated ids are SamplingParams's
    to refuse."""
    if "logit_bias" not in d:
        return ()
    pairs = schema.items(d, "logit_bias", MAX_LOGIT_BIAS, what)
    if not all(
        isinstance(pair, list)
        and len(pair) == 2
        and type(pair[0]) is int
        and 0 <= pair[0] <= MAX_TOKEN
        and type(pair[1]) in (int, float)
        for pair in pairs
    ):
        raise WireError(f"{what}.logit_bias: expected [token id, value] pairs")
    return tuple((pair[0], float(pair[1])) for pair in pairs)


def _boolean(d: dict[str, Any], key: str, what: str) -> bool:
    v = d.get(key)
    if v is not True and v is not False:
        raise WireError(f"{what}.{key}: expected true or false, got {v!r:.40}")
    return v


def _keys(d: dict[str, Any], key: str, max_tokens: int) -> bytes:
    """Page keys (kv.keys.page_keys) of at most the full pages of `max_tokens` positions."""
    if key not in d:
        return b""
    v, most = d[key], max_tokens // PAGE
    if type(v) is not bytes or len(v) % KEY_BYTES or len(v) // KEY_BYTES > most:
        raise WireError(
            f"stage.{key}: expected at most {most} page keys of {KEY_BYTES} bytes "
            "each, as one byte string"
        )
    return v


def _ids(value: Any, n: int) -> tuple[int, ...]:
    """The token ids of the n positions a step sends."""
    if type(value) is not list or len(value) != n:
        raise WireError(f"stage.ids: expected the {n} token ids of the positions sent")
    for i in value:
        if type(i) is not int or not 0 <= i <= MAX_TOKEN:
            raise WireError(f"stage.ids: expected token ids in 0..{MAX_TOKEN}, got {i!r:.40}")
    return tuple(value)


def _rows(value: Any, what: str) -> tuple[np.ndarray, str]:
    """Token ids (i32, [T]) or hidden rows (f32/f16, [T, width], finite) and how they
    travelled."""
    x, dt = _viewed(value, what)
    return tensors.widen(x, what), dt


def _viewed(value: Any, what: str) -> tuple[np.ndarray, str]:
    """``_rows`` as they travelled, validated but neither copied nor checked finite
    (tensors.view)."""
    dt = value.get("dt") if isinstance(value, dict) else None
    if dt == "i32":
        return tensors.view(value, what, ("i32",), (None,)), "i32"
    if dt not in ("f32", "f16"):
        raise WireError(f"{what}.dt: expected one of ['i32', 'f32', 'f16'], got {dt!r:.40}")
    return tensors.view(value, what, ("f32", "f16"), (None, None)), dt


def _delegation(d: dict[str, Any]) -> bytes:
    if "delegation" not in d:
        return b""
    v = d["delegation"]
    if type(v) is not bytes or not 0 < len(v) <= delegation.MAX_BYTES:
        raise WireError(
            f"stage.delegation: expected a signed delegation of at most "
            f"{delegation.MAX_BYTES} bytes"
        )
    return v


def _trace(value: Any, most: int) -> tuple[tuple[float, ...], ...] | None:
    """A traced step's stamps so far; None (dropped, the step goes on) past `most` hops."""
    if not isinstance(value, list):
        raise WireError("stage.trace: expected a list of per-hop stamps")
    if len(value) > most:
        return None
    if not all(
        isinstance(h, list) and len(h) <= MAX_STAMPS and all(type(t) is float for t in h)
        for h in value
    ):
        raise WireError(f"stage.trace: expected lists of at most {MAX_STAMPS} floats")
    return tuple(tuple(h) for h in value)
