"""Spot checks: a peer's output recomputed elsewhere and compared under the numerics tolerance.

Nothing a peer returns proves that it computed it: a stage could answer with rows of the
right shape and a worker with outputs of the right size, at a fraction of the cost, and be
paid as if it worked. So a sample of the work is done twice (docs/verification.md has the
rates, the cost, and a cheater's expected loss):

- ring stages (swarm._Run): the first prompt chunk of every route is relayed hop by hop
  through the gateway, which so sees every hop's input and output rows (a hop cannot tell
  a checked session from another: all are relayed alike). With probability
  ``spot_check_stages`` per hop, that chunk is recomputed by other holders of the hop's
  part (`cover`: one holder of the whole part where there is one, this node first, else a
  chain of holders that together cover it) in throwaway sessions, and compared. A stage's
  output at position t depends on its KV of the positions before t, which only the chunk
  from position 0 lets a checker rebuild: a route that started from a kept prefix is not
  checked (counted as unchecked). The head's answer is a token: it must be the checker's
  (`head_agrees`). A hop can tell the relayed chunk, though, and could compute it honestly
  and lie on the forwarded steps: so a drawn hop is also checked on one of those, after
  the generation ends (``decode``), by commit and reveal: at close every hop commits to
  the digests of what it received and sent at each step (server.ledger); the gateway
  matches each hop's outputs with the next hop's inputs (a hop whose commitment is missing
  or contradicts is paid nothing: `unshown`), asks the drawn hop to show its rows up to a
  step drawn among the later ones, checks them against its commitment, and recomputes
  that step from the inputs shown on other holders of its part (its output, or the head's
  token by `head_agrees`). Its inputs are bound by the hop before it, so a disagreement
  names it, on a route of any peers.
- expert workers (dispatch.ExpertDispatcher.checked): with probability ``spot_check`` per
  call, the rows are recomputed on this node's own copy of the experts or a second replica.

Within one backend an honest recomputation is the same bits (the same chunk, the same
kernels); across backends it is within the numerics contract's tolerance (`divergence`).
A peer out of tolerance is caught: its work for that session is paid to nobody (the
gateway drops its units; a stage leaves the worker out of its Close tally), it is avoided
for unfit_s and accused on gossip, and the evidence is kept here (`SpotChecks.caught`: a
JSON line, and the arrays). A checker that is a peer is one opinion against another: when
they disagree a third decides, and without a third nobody is sentenced (unresolved). A
unit that no other holder (nor this node) can recompute is counted as unchecked, by name,
for the status page.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import Counter, deque
from collections.abc import Container, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvasird.inference.api import TokenEvent
from kvasird.inference.client.routing import Hop, PeerHoldings
from kvasird.logs import get_logger

TIE_SCALE = 60.0
"""A head's token that differs from the checker's is a near tie (not a lie) when the
checker's log probabilities put it within TIE_SCALE x tolerance nats of its own: the
tolerance bounds each logit's change relative to the largest (up to ~30 for LLMs), so a
gap between two tokens moves by at most about 2 x 30 x tolerance."""
MAX_DIVERGENCE = 1e300
"""What evidence says for an output of the wrong shape (JSON has no infinity)."""
KEEP_EVIDENCE = 32
"""Caught checks kept in memory for the status page (all of them go to the evidence file)."""
EVIDENCE_BYTES = 256 << 20
"""Most bytes of evidence arrays kept on disk: past it the oldest files go (a peer that
keeps failing checks must not fill the disk of the node that catches it)."""
EVIDENCE_LOG_BYTES = 16 << 20
"""evidence.jsonl past this size is moved to evidence.jsonl.1 (the one before that goes)."""
log = get_logger("kvasird.inference.client.spotcheck")


def within(rate: float, confidence: float) -> int | None:
    """Checked units (hop-sessions, worker calls) within which a peer that cheats on every
    one is caught with `confidence`, at `rate`: ln(1 - confidence) / ln(1 - rate), rounded
    up (docs/verification.md); None when nothing is checked."""
    if rate <= 0:
        return None
    if rate >= 1:
        return 1
    return math.ceil(math.log(1 - confidence) / math.log(1 - rate))


def divergence(out: np.ndarray, ref: np.ndarray) -> float:
    """How far `out` is from the reference `ref`: max |out - ref| / max |ref|, the measure
    ``[inference] spot_tolerance`` bounds (infinite for a shape that differs)."""
    if out.shape != ref.shape:
        return float("inf")
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-6)
    return float(np.abs(out.astype(np.float64) - ref).max(initial=0.0)) / scale


Output = np.ndarray | tuple[TokenEvent, ...]
"""What a hop answers a step: hidden rows, or at the head the tokens it drew."""


@dataclass(frozen=True)
class Seen:
    """One hop of a relayed step, as the gateway saw it."""

    hop: Hop
    """Who computed what."""
    x: np.ndarray
    """What it was given: token ids (i32) or hidden rows."""
    dt: str
    """The wire type of `x`."""
    out: Output
    """What it answered: hidden rows, or the head's tokens."""


def agrees(out: Output, ref: Output, tolerance: float, greedy: bool) -> tuple[bool, float]:
    """Whether a checked output is within tolerance of the reference, and how far off it is
    (a head's tokens: 0 when they agree, else 1). Heads' tokens are compared where they
    first differ: a speculative step's draws stop at the first one that is not the next
    guess, so two heads given the same guesses draw as many tokens unless a draw differs."""
    if isinstance(out, tuple) or isinstance(ref, tuple):
        ok = (
            isinstance(out, tuple)
            and isinstance(ref, tuple)
            and _heads_agree(out, ref, tolerance, greedy)
        )
        return ok, 0.0 if ok else 1.0
    diff = divergence(out, ref)
    return diff <= tolerance, diff


def _heads_agree(
    out: tuple[TokenEvent, ...], ref: tuple[TokenEvent, ...], tolerance: float, greedy: bool
) -> bool:
    for a, b in zip(out, ref, strict=False):
        if a.token != b.token:
            return head_agrees(a, b, tolerance, greedy)
    return len(out) == len(ref)


def as_array(out: Output) -> np.ndarray:
    """An output as evidence: the rows, or each of the head's tokens with the logprobs it
    reported (a row [token, logprob] and its top alternatives' rows, per token)."""
    if isinstance(out, tuple):
        return np.array(
            [
                row
                for t in out
                for row in ([t.token, t.logprob if t.logprob is not None else np.nan], *t.top)
            ],
            np.float64,
        )
    return out


def head_agrees(checked: TokenEvent, ref: TokenEvent, tolerance: float, greedy: bool) -> bool:
    """Whether a head's token is the one its checker drew, or as good as it (the checker
    reports its top alternatives): greedy, a near tie (rounding may flip the argmax);
    sampled, any token among the checker's top ones (across backends the same draw may
    land on a neighbour in the distribution). A head that did not compute its logits
    returns a token far down the vocabulary."""
    if checked.token == ref.token:
        return True
    top = dict(ref.top)
    if checked.token not in top:
        return False
    if not greedy:
        return True
    best = max(top.values())
    return best - top[checked.token] <= TIE_SCALE * tolerance


def cover(
    hop: Hop, holders: Iterable[PeerHoldings], exclude: Container[str], me: str, rng: random.Random
) -> tuple[Hop, ...] | None:
    """Hops of peers other than those in `exclude` that compute what `hop` computes: its
    layers [first, end), from token ids when it embeds, to a token when it samples. One
    holder of the whole part where there is one (this node first: it is the cheapest and
    an authoritative checker), else a chain, each piece reaching as far as a holder can,
    drawn among equals (a checker is drawn, not the fastest). None when the others do
    not cover it."""
    fit = [h for h in holders if h.peer not in exclude]
    heads = [h.peer for h in fit if h.head]

    def pick(peers: Sequence[str]) -> str:
        return me if me in peers else rng.choice(sorted(peers))

    pieces: list[Hop] = []
    at = hop.first
    while at < hop.end:
        reach: dict[str, int] = {h.peer: b for h in fit for a, b in h.windows if a <= at < b}
        if not reach:
            return None
        end = min(max(reach.values()), hop.end)
        peers = [p for p, b in reach.items() if min(b, hop.end) == end]
        embed = hop.embed and at == hop.first
        head = hop.head and end == hop.end
        both = [p for p in peers if p in heads] if embed or head else peers
        peer = pick(both or peers)
        pieces.append(Hop(peer, at, end, embed and peer in heads, head and peer in heads))
        at = end
    if hop.embed and not (pieces and pieces[0].embed):
        if not heads:
            return None
        pieces.insert(0, Hop(pick(heads), hop.first, hop.first, True, False))
    if hop.head and not (pieces and pieces[-1].head):
        if not heads:
            return None
        pieces.append(Hop(pick(heads), hop.end, hop.end, False, True))
    return tuple(pieces)


def unit_name(hop: Hop) -> str:
    """A hop's part as the status page names units: layers inclusive, and the head."""
    n = hop.end - hop.first
    parts = [f"layer {hop.first}" if n == 1 else f"layers {hop.first}-{hop.end - 1}"] if n else []
    if hop.embed or hop.head:
        parts.append("head")
    return " + ".join(parts)


def sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@dataclass(frozen=True)
class Evidence:
    """One caught check, as the checking node keeps it."""

    kind: str
    """"stage" (its first prompt chunk), "decode" (its decode steps, by a replay of the
    session) or "experts"."""
    peer: str
    """The peer caught out of tolerance."""
    unit: str
    """What it was asked to compute ("layers 10-29", "experts 0-7 of layer 3", ...)."""
    checkers: tuple[str, ...]
    """Who recomputed it (this node's own id for its own copy)."""
    input_sha256: str
    """Of the input rows (or token ids) both were given, as float32/int32 bytes (for
    "decode": the token history replayed)."""
    output_sha256: str
    """Of the caught peer's output."""
    reference_sha256: str
    """Of the checkers' output."""
    divergence: float
    """max |output - reference| / max |reference| (rows), or 1.0 for a head's wrong token."""
    tolerance: float
    """What the check allowed."""
    verdict: str
    """"caught": out of tolerance, and its session's work is paid to nobody."""
    sessions: int
    """Sessions (hop-sessions, or worker calls) of this peer this node had run when it
    caught it: how long the cheat went unseen."""
    at: float
    """Unix time of the verdict."""
    arrays: str
    """The file (beside the evidence file) holding input, output and reference ("" when
    this node keeps no files)."""


@dataclass
class Counts:
    """Counts of one kind of check (stages, or expert calls)."""

    rate: float
    """The configured probability of a check."""
    seen: int = 0
    """Units of work that could have been drawn (hop-sessions, worker calls)."""
    checked: int = 0
    """Recomputed and compared."""
    worst_pass: float = 0.0
    """The largest divergence a check accepted: how close honest peers come to the
    tolerance (0 where checked and checker run the same backend)."""
    caught: int = 0
    """Out of tolerance."""
    unresolved: int = 0
    """Two peers disagreed and no third could decide (nobody was sentenced)."""
    failed: int = 0
    """Drawn, but a checker failed before it answered (nothing held against the peer)."""
    unchecked: int = 0
    """Drawn, but nobody else could recompute it (or, for a stage, its route started from
    a kept prefix)."""
    unshown: int = 0
    """Hops that could not show their work (decode: no commitment at close, one that
    contradicts this node or the next hop, rows it did not keep or that are not what it
    committed to): paid nothing for the generation, not accused (which of two hops that
    contradict each other lied is not known)."""


class SpotChecks:
    """This node's spot checks: the draw, the counts, the units nobody can check, and the
    evidence of every peer caught (kept in `directory`, when given)."""

    def __init__(
        self,
        stage_rate: float,
        expert_rate: float,
        tolerance: float,
        directory: Path | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.tolerance, self.directory = tolerance, directory
        self.rng = rng or random.Random()
        """Draws checks and checkers (a peer must not predict either)."""
        self.stages, self.experts = Counts(stage_rate), Counts(expert_rate)
        self.decode = Counts(stage_rate)
        """The stages drawn, checked again on a step after the first chunk (commit and
        reveal: swarm._Run.check_decode), and every hop's commitments compared (`unshown`)
        (`seen`: the drawn hops whose route computed a step after its first chunk)."""
        self.unchecked: Counter[str] = Counter()
        """Unit name -> times it was drawn and nobody else could recompute it."""
        self.sessions: Counter[str] = Counter()
        """Peer -> hop-sessions or worker calls of it this node could have checked."""
        self.evidence: deque[Evidence] = deque(maxlen=KEEP_EVIDENCE)
        self.disk_bytes, self.log_bytes = EVIDENCE_BYTES, EVIDENCE_LOG_BYTES
        """What the evidence arrays in `directory` may take at most (the oldest go first),
        and the size at which evidence.jsonl is moved aside."""

    def draw(self, counts: Counts, peer: str) -> bool:
        """Whether this unit of `peer`'s work is checked."""
        counts.seen += 1
        self.sessions[peer] += 1
        return counts.rate > 0 and self.rng.random() < counts.rate

    def compared(self, counts: Counts, diff: float) -> bool:
        """A check done, `diff` off its reference: whether that is within tolerance."""
        counts.checked += 1
        ok = diff <= self.tolerance
        if ok:
            counts.worst_pass = max(counts.worst_pass, diff)
        return ok

    def nobody(self, counts: Counts, unit: str) -> None:
        """A drawn unit that nobody else can recompute."""
        counts.unchecked += 1
        self.unchecked[unit] += 1

    def caught(
        self,
        kind: str,
        peer: str,
        unit: str,
        checkers: Sequence[str],
        x: np.ndarray,
        out: np.ndarray,
        ref: np.ndarray,
        diff: float,
    ) -> Evidence:
        """Keep the evidence of `peer` caught: in memory for the status page, and as a JSON
        line (and the arrays) in `directory`."""
        {"stage": self.stages, "decode": self.decode, "experts": self.experts}[kind].caught += 1
        at = time.time()
        name = ""
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            caught = self.stages.caught + self.decode.caught + self.experts.caught
            name = f"{int(at * 1000)}-{caught}-{kind}-{peer[-12:]}.npz"  # unique within a ms
            np.savez_compressed(self.directory / name, input=x, output=out, reference=ref)
        ev = Evidence(
            kind,
            peer,
            unit,
            tuple(checkers),
            sha256(x),
            sha256(out),
            sha256(ref),
            min(diff, MAX_DIVERGENCE),
            self.tolerance,
            "caught",
            self.sessions[peer],
            at,
            name,
        )
        self.evidence.append(ev)
        if self.directory is not None:
            self._append(json.dumps(asdict(ev)) + "\n")
            self._prune()
        log.warning(
            "a peer failed a spot check: its work for the session is not paid",
            kind=kind,
            peer=peer,
            unit=unit,
            divergence=diff,
            tolerance=self.tolerance,
        )
        return ev

    def _append(self, line: str) -> None:
        """One line onto evidence.jsonl, moved aside first once it is `log_bytes`."""
        assert self.directory is not None
        log_path = self.directory / "evidence.jsonl"
        if log_path.exists() and log_path.stat().st_size >= self.log_bytes:
            log_path.replace(log_path.with_name("evidence.jsonl.1"))
        with log_path.open("a") as f:
            f.write(line)

    def _prune(self) -> None:
        """The oldest evidence arrays removed until the rest fit in `disk_bytes` (their JSON
        lines stay: the hashes in them still say what was compared)."""
        assert self.directory is not None
        files = sorted(self.directory.glob("*.npz"), key=lambda f: f.stat().st_mtime_ns)
        total = sum(f.stat().st_size for f in files)
        for f in files[:-1]:  # the newest stays, whatever its size
            if total <= self.disk_bytes:
                break
            total -= f.stat().st_size
            f.unlink()

    def status(self) -> dict[str, Any]:
        return {
            "stages": {**asdict(self.stages), "within_95": within(self.stages.rate, 0.95)},
            "decode": asdict(self.decode),
            "experts": {**asdict(self.experts), "within_95": within(self.experts.rate, 0.95)},
            "tolerance": self.tolerance,
            "unchecked_units": dict(self.unchecked),
            "evidence": [asdict(e) for e in self.evidence],
        }
