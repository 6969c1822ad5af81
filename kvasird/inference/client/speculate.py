"""Speculative decoding on a route of peers: guess the next tokens here, check them in one
pass of the ring.

A token of a ring waits for one whole circuit: on links 20 ms apart a 3-hop ring makes at
most 1 / (60 ms + compute) tokens a second, whatever the hardware. So the gateway guesses
k tokens and sends them with the last one as one step (Step.verify):

    _Run.step ─▶ Speculator.guess(history) ─▶ k guesses (Lookup, or a DraftModel here)
        ─▶ [last, g1..gk] along the route: every hop computes the k+1 positions, the head
           draws after each and stops at the first draw that is not the next guess
        ─▶ the tokens drawn (the guesses accepted, then the head's own) ─▶ Speculator.learn

Exact by construction, two ways:
- The head draws each token from its seeded stream exactly as a decode step would, and a
  guess counts only where it equals that draw ("draw and compare"). For a guess that is
  one token (a lookup, a greedy draft) this accepts it with probability p(guess) and
  otherwise gives a token drawn from p without it: the target distribution, as the
  accept/reject rule of speculative sampling gives it for such a draft, and moreover the
  very tokens a run without speculation draws under the same seed. A failover replay
  skips one draw per token produced, as before.
- The hops compute the positions one at a time (as Step.singly does for a replay), so
  each row holds the bits a decode step of it would. Measured on the bundled model: k
  rows as one batch differ from k steps of one by up to 0.5 in the logits for k >= 3
  (two rows were equal), which flips a greedy argmax at a near tie: greedy output would be
  the same "to numerics", not token for token. Computing singly costs compute that a
  batch would share (9 rows: 110 ms singly, 53 ms as one batch, on this 2-core machine),
  and spares what speculation is for: the circuit. ``[inference] speculate_exact = false``
  checks the rows as one batch instead: cheaper, equal to float rounding. Computed
  singly, each hop hands every row on as soon as it has computed it (Step.part), so the
  hops compute a check's rows side by side: a further row costs the route about its
  slowest hop's row, not every hop's in turn (on bench_wan's 20 ms ring, 12 ms -> 5 ms
  a row), and the head answers at its first miss, before the rows after it reach it.
Rows past the first rejection are forgotten by every hop when the next step starts before
them (the KV pool's reserve drops positions >= start). A delta-net layer's state holds
everything before its position and cannot go back, so a hop holding one computes a
speculative step one position at a time, however ``speculate_exact`` is set, and copies
its state after each position but the last (KV pool: Session.keep_rewind); the next step
starts from the copy where the head rejected a guess.

How many to guess (``draft_k`` = 0): from what this node measured on the route, per
source. A step of 1 + k rows takes t1 + k * t_row (t1: a plain step's circuit and compute;
t_row: each further row's compute at every hop), plus k * t_guess to guess them; with a
chance a that each guess is accepted, it yields (1 - a^(k+1)) / (1 - a) tokens. k is the
one that yields the most tokens a second, 0 where none pays: on loopback a ring's step is
mostly compute, t_row is near t1, and speculation turns itself off. Every PROBE_EVERY-th
step is a plain one (t1 stays measured); the first speculative ones guess PROBE_K. Where k
is 0, one step now and then (16, 32, 64, ... up to MAX_PROBE_EVERY steps apart, across the
node's generations) still guesses one token, so estimates taken in a bad moment do not turn
speculation off for good. A draft model's t_guess leaves out its catching up with the
prompt, which it does while the ring computes the prompt (Speculator.prepare), and with the
tokens of steps without guesses, which it reads beside the route's next steps before it
guesses again (Speculator._behind).

Sources: Lookup (prompt lookup: what followed the last few tokens where they occurred
before in the context; no model, strong where answers quote their prompt: editing, code,
agents' tool results) and DraftModel (a small GGUF with the served model's vocabulary,
run on this node, checked against the served model's tokens at load).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import trio

from kvasird.compute.errors import ComputeError
from kvasird.errors import ModelError
from kvasird.logs import get_logger
from kvasird.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the engine (ggml) loads only where a draft model does
    from kvasird.compute.kv.pool import Session
    from kvasird.compute.stage import Stage

log = get_logger("kvasird.inference.client.speculate")

MAX_K = 16
"""Most tokens guessed per step (adaptive)."""
PROBE_K = 4
"""Guesses per step until the cost of a further row has been measured."""
PROBE_EVERY = 16
"""One decode step in this many is a plain one, so a plain step's time stays measured."""
MAX_PROBE_EVERY = 256
"""Where no guess pays, one step in at most this many still guesses PROBE_K tokens."""
EWMA = 0.2
NGRAM = (4, 3, 2)
"""Lengths of the context's tail that prompt lookup looks for, longest first."""
PRIOR_ACCEPT = {"lookup": 0.5, "draft": 0.7}


class SpeculationError(ModelError):
    """A draft model that cannot draft for the served model."""


@dataclass
class Estimates:
    """What speculation on routes from this node has measured, per source."""

    accepted: float = 0.0
    """Guesses accepted (decayed)."""
    examined: float = 0.0
    """Guesses the head compared with its draw (decayed): accepted / examined is the
    chance of a guess being accepted, the maximum-likelihood one for guesses that stop at
    the first miss."""
    t1: float | None = None
    """Seconds of a plain step (EWMA)."""
    t_row: float | None = None
    """Seconds each further row of a speculative step adds (EWMA)."""
    t_guess: float = 0.0
    """Seconds to guess one token here (EWMA)."""
    prior: float = 0.5
    idle: int = 0
    """Steps since the last guess, while no guess pays."""
    probe_every: int = PROBE_EVERY
    """Steps between single guesses while none pays (doubling each time it still does not,
    up to MAX_PROBE_EVERY, across this node's generations): costs change (a route, a link,
    a busy moment), so what made k 0 is measured again, at a cost of one row in so many."""

    def accept_rate(self) -> float:
        return (self.accepted + 2 * self.prior) / (self.examined + 2)

    def best_k(self, room: int) -> int:
        """The number of guesses that yields the most tokens a second (0: none pays)."""
        if self.t1 is None:
            return 0
        if self.t_row is None:
            return min(PROBE_K, room)
        a = min(self.accept_rate(), 0.999)
        best, rate = 0, 1 / self.t1
        for k in range(1, min(MAX_K, room) + 1):
            r = (1 - a ** (k + 1)) / (1 - a) / (self.t1 + k * (self.t_row + self.t_guess))
            if r > rate * 1.02:  # a guess must pay a little more than noise
                best, rate = k, r
        return best

    def probe_due(self) -> bool:
        """Counts a step where best_k says no guess pays; whether one guess is due (once in
        probe_every such steps). It stays due until ``probed``."""
        self.idle += 1
        return self.idle >= self.probe_every

    def probed(self) -> None:
        self.idle, self.probe_every = 0, min(2 * self.probe_every, MAX_PROBE_EVERY)

    def learn(self, guessed: int, drawn: int, seconds: float) -> None:
        """A step with `guessed` guesses drew `drawn` tokens in `seconds`.

        A plain step is timed once in PROBE_EVERY, so its estimate must not lag: it falls
        to a faster plain step at once and rises halfway to a slower one (a first step
        slowed by the machine, a warm-up, a route since replaced, kept k above 0 on a
        loopback ring for a hundred steps and more, at half the plain speed). A step with
        guesses that took less than the estimate proves it stale: it becomes the estimate,
        and that step says nothing of a row's cost."""
        if guessed == 0:
            t1 = self.t1
            self.t1 = seconds if t1 is None or seconds < t1 else (t1 + seconds) / 2
            return
        accepted = drawn - 1
        keep = 1 - EWMA / 4
        self.accepted = self.accepted * keep + accepted
        self.examined = self.examined * keep + accepted + (accepted < guessed)
        if self.t1 is not None and seconds < self.t1:
            self.t1 = seconds
        elif self.t1 is not None:
            row = (seconds - self.t1) / guessed
            self.t_row = row if self.t_row is None else (1 - EWMA) * self.t_row + EWMA * row


def _same_tail(assumed: Sequence[int], history: Sequence[int], n: int = 64) -> bool:
    """Whether `history` is what a step drafted ahead for: the same length and end (the
    start is the generation's own, the same by construction)."""
    return len(assumed) == len(history) and list(assumed[-n:]) == list(history[-n:])


def lookup(history: Sequence[int], k: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the
    context's last NGRAM tokens (the longest that occurs), or none."""
    arr = np.asarray(history, np.int64)
    n_all = len(arr)
    for n in NGRAM:
        if n_all <= n or k <= 0:
            continue
        tail = arr[-n:]
        starts = np.flatnonzero(arr[: n_all - n] == tail[0])
        for s in starts[::-1]:  # the latest occurrence first
            if s + n < n_all and np.array_equal(arr[s : s + n], tail):
                return [int(t) for t in arr[s + n : s + n + k]]
    return []


class DraftModel:
    """A small model with the served model's vocabulary, whole on this node, that drafts.

    One stage of the whole GGUF, shared by the generations of this node; each has its own
    session (DraftSession), which keeps its KV in step with the generation's history."""

    def __init__(self, path: str, target_tokens: Sequence[str] | None, threads: int = 0) -> None:
        from kvasird.compute.kv.pool import KVSpec
        from kvasird.compute.stage import Stage

        self.path = Path(path).expanduser()
        if target_tokens is not None:
            check_vocabulary(self.path, target_tokens)
        # a delta-net draft keeps a copy of its state per guess, of two steps at a time
        kv = KVSpec(n_slots=8192, dtype="f16", state_slots=2 * MAX_K + 4)
        self.stage = Stage.load(self.path, threads=threads, kv=kv)

    def open(self) -> DraftSession:
        return DraftSession(self.stage)

    def close(self) -> None:
        self.stage.close()


def check_vocabulary(path: Path, target: Sequence[str]) -> None:
    """Refuse a draft model whose tokens are not the served model's (its guesses would be
    other tokens' ids): the same strings for every id the served model has."""
    tokens = Tokenizer.from_gguf(path).tokens
    if len(tokens) < len(target) or any(a != b for a, b in zip(tokens, target, strict=False)):
        raise SpeculationError(
            f"{path}: its vocabulary ({len(tokens)} tokens) is not the served model's "
            f"({len(target)}): set [inference] draft_model to a model of the same tokenizer, "
            'or speculate = "lookup"'
        )


@dataclass
class DraftSession:
    """One generation's drafts: the draft model's KV holds `held`, a prefix of the history."""

    stage: Stage
    held: list[int] = field(default_factory=list)
    session: Session | None = None

    def guess(
        self, history: Sequence[int], k: int, confirmed: int | None = None
    ) -> tuple[list[int], float]:
        """k tokens the draft model draws greedily after `history`, and the seconds that
        cost beyond reading the history it had not read (a prompt, the tokens of steps
        without guesses: of that first forward only the last token's share counts). A
        stretch of 10-17 tokens counted whole made a one-token probe look 50 ms dear on
        bench_wan, and turned the draft off at 20 ms a link. `history` is the route's from
        position `confirmed` on only as far as guessed (drafting ahead): the draft keeps
        its way back to each of those positions. Blocking: run it in a worker thread."""
        # the last token is fed to get the first guess
        confirmed = len(history) if confirmed is None else confirmed
        session, same = self._kept(history, len(history) - 1, confirmed - 1)
        if session.n_past == same:
            session.keep_rewind()  # the token fed now may be a guess the route rejects
        ids = np.asarray(history[same:], np.int32)
        began = time.perf_counter()
        logits = self.stage.forward(session, ids, same)
        if len(ids) > 1:
            now = time.perf_counter()
            began = now - (now - began) / len(ids)
        self.held = list(history)
        out: list[int] = []
        while True:
            token = int(np.argmax(logits[-1]))
            out.append(token)
            if len(out) == k:
                return out, time.perf_counter() - began
            session.keep_rewind()  # a delta-net's way back to here (no-op for attention)
            logits = self.stage.forward(session, np.array([token], np.int32), len(self.held))
            self.held.append(token)

    def catch_up(self, history: Sequence[int]) -> None:
        """Feed `history` to the draft model (a prompt, while the ring computes it), so that
        the first guess is not held up by it. Blocking: run it in a worker thread."""
        session, same = self._kept(history, len(history), len(history))
        if same < len(history):
            self.stage.forward(session, np.asarray(history[same:], np.int32), same)
        self.held = list(history)

    def behind(self, history: Sequence[int]) -> int:
        """Tokens of `history` the draft model has not read (after the last it shares)."""
        return len(history) - self._shared(history)

    def _shared(self, history: Sequence[int]) -> int:
        same = 0
        for a, b in zip(self.held, history, strict=False):
            if a != b:
                break
            same += 1
        return same

    def _kept(self, history: Sequence[int], upto: int, settled: int) -> tuple[Session, int]:
        """The draft's session (opened if none), and the position it goes on from: how
        much of `history` its KV holds, at most `upto` (a delta-net's state goes back only
        to a copy kept after a guess, else it starts over). Copies before `settled` are
        dropped: the route will not go back there."""
        if self.session is None:
            self.session = self.stage.open_session()
        session, same = self.session, min(self._shared(history), upto)
        if session.n_past <= same:
            session.drop_rewinds(before=settled)
        elif self.stage.kv.recurrent and same not in session.rewinds:
            same = 0  # a delta-net's state cannot go back without a copy: from the start
        return session, same

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


class Speculator:
    """One generation's speculation: the source, and the estimates it learns into."""

    def __init__(
        self, source: str, estimates: Estimates, draft: DraftModel | None, fixed_k: int
    ) -> None:
        self.source, self.estimates, self.fixed_k = source, estimates, fixed_k
        self.session = draft.open() if draft is not None else None
        self.steps = 0
        self.guessed = 0
        self.accepted = 0
        self._drafting = trio.Lock()
        """Held while the draft model computes (its session is one thread's at a time)."""
        self._nursery: trio.Nursery | None = None
        self._ahead: tuple[list[int], list[int]] | None = None
        """(the history a step drafted ahead for, its guesses): see draft_ahead."""
        self._hit = False
        """Whether the last guesses were drafted while the route checked the step before."""
        self._reading = False
        """Whether the draft model is reading a stretch of the history (_behind)."""

    async def guess(self, history: Sequence[int], room: int) -> tuple[int, ...]:
        """The guesses for the next step (none: a plain step), at most `room`."""
        self.steps += 1
        est = self.estimates
        if self.fixed_k:
            k = self.fixed_k
        elif est.t1 is None or self.steps % PROBE_EVERY == 1:
            k = 0  # a plain step, timed
        else:
            k = est.best_k(room)
            probe = not k and est.probe_due()
            if probe or k:
                if self._behind(history):
                    return ()  # the guesses (a probe stays due) wait until it has read
                if probe:
                    est.probed()
                    k = 1
        k = min(k, room)
        if k <= 0:
            return ()
        if self.session is None:
            return tuple(lookup(history, k))
        waited = time.perf_counter()
        async with self._drafting:
            ahead, self._ahead = self._ahead, None
            if ahead is not None and len(ahead[1]) >= k and _same_tail(ahead[0], history):
                self._hit = True
                seconds = time.perf_counter() - waited  # what the step waited for them
                out = ahead[1][:k]
            elif self.session is None:  # the draft failed ahead
                return tuple(lookup(history, k))
            else:
                try:
                    out, seconds = await trio.to_thread.run_sync(
                        self.session.guess, list(history), k
                    )
                except ComputeError as exc:  # the generation goes on without its guesses
                    self._failed(exc)
                    return tuple(lookup(history, k))
        per = seconds / k
        est.t_guess = (1 - EWMA) * est.t_guess + EWMA * per if est.t_guess else per
        return tuple(out)

    def _behind(self, history: Sequence[int]) -> bool:
        """Whether the draft model has yet to read more of `history` than a guess feeds it
        (after steps without guesses): then it reads it beside the route's next steps,
        which go on without guesses meanwhile. Read as a guess, the stretch held the step
        up: on bench_wan's 0 ms ring a probe after a hundred plain steps waited 0.3-0.5 s
        for it, and the draft rows gave 0.83-0.90x of no speculation, with 4 guesses."""
        if self.session is None or self._nursery is None or self.fixed_k:
            return False
        if not self._reading and self.session.behind(history) > MAX_K + 1:
            self._reading = True
            self._nursery.start_soon(self._catch_up, list(history))
        return self._reading

    def take_ahead_hit(self) -> int:
        """1 if the last guesses were drafted ahead (then forgotten), else 0."""
        hit, self._hit = self._hit, False
        return int(hit)

    def prepare(self, nursery: trio.Nursery | None, prompt: Sequence[int]) -> None:
        """Start the draft model on the prompt while the ring computes it (in `nursery`;
        without one, the first guess feeds it, and no step drafts ahead)."""
        self._nursery = nursery
        if self.session is not None and nursery is not None:
            self._reading = True
            nursery.start_soon(self._catch_up, list(prompt))

    def draft_ahead(self, history: Sequence[int], guesses: Sequence[int]) -> None:
        """While the route checks `guesses` after `history`: draft the step after, were
        they all kept. The draft model guesses the head's own token after them and k more
        after that one; when the route's tokens are those, the next step's guesses are
        ready (or computing) the moment the route answers, so a draft model's time
        overlaps the circuit's instead of adding to it. In the service's nursery; a
        failure is logged and the draft model is given up for the generation."""
        if self.session is None or self._nursery is None or not guesses:
            return
        self._ahead = None
        self._nursery.start_soon(self._run_ahead, [*history, *guesses], len(history))

    async def _run_ahead(self, assumed: list[int], confirmed: int) -> None:
        k = len(assumed) - confirmed
        async with self._drafting:
            if self.session is None:
                return
            try:
                out, _ = await trio.to_thread.run_sync(
                    self.session.guess, assumed, k + 1, confirmed
                )
            except Exception as exc:  # noqa: BLE001 - the daemon's nursery must not fail
                self._failed(exc)
                return
            self._ahead = ([*assumed, out[0]], out[1:])

    def _failed(self, exc: Exception) -> None:
        log.warning("the draft model failed: guessing from the context", error=repr(exc))
        if self.session is not None:
            self.session.close()
            self.session = None

    async def _catch_up(self, prompt: list[int]) -> None:
        """In the service's nursery: a failure is logged, never raised (the first guess
        then feeds the prompt itself, and fails in its generation, if it must)."""
        try:
            async with self._drafting:
                if self.session is not None:
                    try:
                        await trio.to_thread.run_sync(self.session.catch_up, prompt)
                    except Exception as exc:  # noqa: BLE001 - the nursery must not fail
                        log.warning("the draft model could not read the history", error=repr(exc))
        finally:
            self._reading = False

    def learn(self, guessed: int, drawn: int, seconds: float) -> None:
        self.guessed += guessed
        self.accepted += max(drawn - 1, 0) if guessed else 0
        self.estimates.learn(guessed, drawn, seconds)

    async def aclose(self) -> None:
        """Close the draft session once no thread computes on it."""
        async with self._drafting:
            if self.session is not None:
                self.session.close()
                self.session = None
