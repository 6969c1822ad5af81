"""Proofs of holding: a peer's claim to hold units is believed once it answered a challenge.

Anyone can sign a coverage record that claims the head, every layer and a 1 TiB budget.
Such a record drew every gateway into a failover, and, counted by the market, could talk
honest holders into giving units up (#24). So a claim is checked before it is trusted:

    claim     the units a peer's newest record holds online (all of them when it says it
              has the whole model), per boot of that peer: a restart is checked afresh
    pick      CHALLENGES spans at random among the pieces of the units not yet proven (a
              span is a whole piece or one 4 MiB chunk of it: the manifest's grain)
    ask       over the shard protocol, a stream per question:
                a span we hold ourselves: "prove" with a fresh nonce and RANGES random
                  byte ranges inside it -> sha256(nonce || those bytes), 32 bytes back,
                  which only a holder of the bytes can compute
                a span we lack: "read" it whole -> checked against the manifest's hash
                  of it (costs the span's bytes, at most 4 MiB; most pieces are smaller)
    verdict   right answers  -> the claimed units are proven (until the peer restarts)
              wrong bytes    -> a liar at once
              "not held" for a unit its newest record still claims, twice in a row (the
                first may race a drop whose record is still on its way) -> a liar
              no answer (a timeout, no route, a busy peer) -> not proven; asked again
                after a back-off that doubles from RETRY_S up to MAX_RETRY_S (15 s)

A liar (so is a holder a download caught sending wrong bytes: ``condemn``) is reported
to ``on_liar`` (the market takes it out of its map and refuses its records) and stays
banned for LIAR_BAN_S, across its restarts: each node catches liars for itself, so a lie
costs its author its place in every map that it reached.

Routing (InferenceService.holders) uses proven units only. The market's counts use every
record not caught lying: joining and loading holdings cannot be proven yet, and counts
that dipped at every change of state would churn enrollment.

Module layout: ``pick`` (pure: spans and questions from a manifest and a seeded rng),
``ClaimChecker`` (the queue of claims to check, the verdicts, the bans; one trio task).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from kvasird.logs import get_logger
from kvasird.market.records import CoverageRecord
from kvasird.model.manifest import CHUNK_SIZE, Manifest, Piece, Unit
from kvasird.model.store import ShardStore
from kvasird.model.transfer import OpenStream, PeerMissing, ProveAsk, ReadAsk, ask, proof_digest

log = get_logger("kvasird.market.proofs")

CHALLENGES = 2
"""Spans asked per claim: a peer holding a fraction f of what it claims passes with f**2."""
RANGES = 4
"""Byte ranges per "prove" question."""
RANGE_BYTES = 4096
"""Longest of those ranges."""
TIMEOUT_S = 15.0
"""For one question, stream opening included."""
RETRY_S = 1.0
MAX_RETRY_S = 15.0
"""An unanswered claim is asked again soon: until it is proven the peer is not routed to,
and the usual reasons (a peer just restarted, stopped for a moment, its address not yet
dialled) pass in seconds. A longer back-off kept a restarted replica out of routes for
minutes in the churn soak (bench/soak.py), and requests failed."""
LIAR_BAN_S = 3600.0
"""How long a peer caught lying stays out of this node's map (its restarts do not end it)."""
PARALLEL = 4
"""Claims checked at once."""


@dataclass(frozen=True)
class Question:
    """One challenge: a span of a piece, asked as a proof (we hold it) or a read (we do not)."""

    piece: Piece
    offset: int
    """Of the span, within the piece."""
    length: int
    """Of the span."""
    sha256: bytes
    """The manifest's hash of the span."""
    ranges: tuple[tuple[int, int], ...]
    """(offset within the piece, length) asked for a proof; empty for a read."""

    def request(self, model_id: str, nonce: bytes) -> ReadAsk | ProveAsk:
        p = self.piece
        if not self.ranges:
            return ReadAsk(model_id, ((p.tensor, p.expert, self.offset, self.length),))
        return ProveAsk(model_id, nonce, tuple((p.tensor, p.expert, o, n) for o, n in self.ranges))


def pick(
    manifest: Manifest,
    units: Iterable[Unit],
    have: Callable[[Piece], bool],
    rng: np.random.Generator,
    n: int = CHALLENGES,
) -> list[Question]:
    """``n`` questions on spans drawn uniformly among the pieces of ``units`` (fewer when
    there are fewer spans). ``have(piece)``: whether we hold it intact ourselves."""
    spans = [
        (p, off, length, sha)
        for p in manifest.pieces(units)
        for off, length, sha in p.spans(CHUNK_SIZE)
    ]
    if not spans:
        return []
    out = []
    for i in rng.choice(len(spans), size=min(n, len(spans)), replace=False):
        piece, off, length, sha = spans[int(i)]
        ranges: tuple[tuple[int, int], ...] = ()
        if have(piece):
            sizes = rng.integers(1, min(RANGE_BYTES, length) + 1, size=RANGES)
            ranges = tuple((off + int(rng.integers(0, length - int(s) + 1)), int(s)) for s in sizes)
        out.append(Question(piece, off, length, sha, ranges))
    return out


def claimed(record: CoverageRecord, manifest: Manifest) -> set[Unit]:
    """What a record says its peer can serve or seed now."""
    if record.has_all:
        return set(manifest.unit_sizes)
    return {u for h in record.holdings if h.state == "online" for u in h.units()}


@dataclass
class _Claims:
    boot: str
    proven: set[Unit]
    missing: set[Unit]
    """Units it answered "not held" for once (a second time makes it a liar)."""
    retry_at: float = 0.0
    backoff_s: float = RETRY_S


class ClaimChecker:
    """Checks the claims of peers' records, one trio task (``run``), as records come in."""

    def __init__(
        self,
        me: str,
        store: ShardStore,
        open_stream: OpenStream,
        latest: Callable[[str], CoverageRecord | None],
        on_liar: Callable[[str, str], None],
        rng: np.random.Generator,
        *,
        on_pardon: Callable[[str], None] = lambda peer: None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.me, self.store, self.open_stream = me, store, open_stream
        self.latest = latest
        """The newest record of a peer in the map (None once it left)."""
        self.on_liar, self.on_pardon = on_liar, on_pardon
        self.rng = rng
        self.timeout_s = timeout_s
        self.claims: dict[str, _Claims] = {}
        self.liars: dict[str, tuple[float, str]] = {}
        """peer -> (trio time its ban ends, why)."""
        self.version = 0
        """Bumped whenever a verdict changes what is proven (routing caches by it)."""
        self.asked = {"prove": 0, "read": 0, "read_bytes": 0}
        self._due: set[str] = set()
        self._wake = trio.Event()

    # --- what routing and the market ask ------------------------------------------------

    def proven(self, record: CoverageRecord) -> frozenset[Unit]:
        """The units of ``record`` that its peer proved it holds (in this boot)."""
        c = self.claims.get(record.peer)
        if c is None or c.boot != record.boot:
            return frozenset()
        return frozenset(c.proven)

    def banned(self, peer: str) -> bool:
        ban = self.liars.get(peer)
        if ban is None:
            return False
        if ban[0] < trio.current_time():
            del self.liars[peer]
            log.info("a liar's ban ended", peer=peer)
            self.on_pardon(peer)
            return False
        return True

    def note(self, record: CoverageRecord, manifest: Manifest) -> None:
        """A record was applied: check it if it claims units not yet proven."""
        if record.peer == self.me or self.banned(record.peer):
            return
        c = self.claims.get(record.peer)
        if c is None or c.boot != record.boot:
            c = self.claims[record.peer] = _Claims(record.boot, set(), set())
            self.version += 1
        if claimed(record, manifest) - c.proven and record.peer not in self._due:
            self._due.add(record.peer)
            self._wake.set()

    def forget(self, peer: str) -> None:
        """The peer left the map: its proofs go with it (a ban stays)."""
        if self.claims.pop(peer, None) is not None:
            self.version += 1
        self._due.discard(peer)

    def view(self) -> dict[str, Any]:
        now = trio.current_time()
        return {
            "liars": {p: why for p, (until, why) in self.liars.items() if until >= now},
            "proven_units": {p: len(c.proven) for p, c in self.claims.items()},
            "unproven": sorted(self._due),
            "asked": dict(self.asked),
        }

    # --- the task -----------------------------------------------------------------------

    async def run(
        self,
        manifest: Callable[[], Manifest | None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        limit = trio.CapacityLimiter(PARALLEL)
        running: set[str] = set()
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self._wake = trio.Event()
                now = trio.current_time()
                for liar in list(self.liars):
                    self.banned(liar)  # ends the bans that ran out
                m = manifest()
                for peer in sorted(self._due - running):
                    c = self.claims.get(peer)
                    if m is None or c is None or c.retry_at > now:
                        continue
                    running.add(peer)
                    nursery.start_soon(self._check_one, peer, m, limit, running)
                with trio.move_on_after(1.0):
                    await self._wake.wait()

    async def _check_one(
        self, peer: str, manifest: Manifest, limit: trio.CapacityLimiter, running: set[str]
    ) -> None:
        try:
            async with limit:
                await self.check(peer, manifest)
        finally:
            running.discard(peer)
            self._wake.set()

    async def check(self, peer: str, manifest: Manifest) -> str:
        """Challenge ``peer``'s newest claim once; returns the verdict ("proven", "liar",
        "doubt", "unanswered", "nothing")."""
        record, c = self.latest(peer), self.claims.get(peer)
        if record is None or c is None or c.boot != record.boot or self.banned(peer):
            self._due.discard(peer)
            return "nothing"
        wanted = claimed(record, manifest) - c.proven
        if not wanted:
            self._due.discard(peer)
            return "nothing"
        questions = await trio.to_thread.run_sync(
            pick, manifest, wanted, self.store.check_piece, self.rng
        )
        try:
            for q in questions:
                if not await self._ask(peer, manifest.model_id, q):
                    self._liar(
                        peer,
                        f"answered wrong bytes for {q.piece.tensor}"
                        f"{'' if q.piece.expert < 0 else f' expert {q.piece.expert}'}",
                    )
                    return "liar"
        except PeerMissing:
            newest = self.latest(peer)
            if newest is not None and wanted & c.missing and wanted <= claimed(newest, manifest):
                self._liar(peer, "claims units it says it does not hold")
                return "liar"
            c.missing |= wanted
            self._later(peer, c, "said it lacks units it claims")
            return "doubt"
        except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - unreachable, slow, gone
            self._later(peer, c, repr(exc)[:200])
            return "unanswered"
        if self.claims.get(peer) is not c:  # it restarted meanwhile: its new claim is due
            return "nothing"
        c.proven |= wanted
        c.missing -= wanted
        c.backoff_s = RETRY_S
        self.version += 1
        newest = self.latest(peer)
        if newest is None or not claimed(newest, manifest) - c.proven:
            self._due.discard(peer)
        log.info("claim proven", peer=peer, units=len(wanted), questions=len(questions))
        return "proven"

    async def _ask(self, peer: str, model_id: str, q: Question) -> bool:
        nonce = secrets.token_bytes(32)
        if q.ranges:
            self.asked["prove"] += 1
            mine = await trio.to_thread.run_sync(
                lambda: [
                    self.store.read_range(model_id, q.piece.tensor, q.piece.expert, o, n)
                    for o, n in q.ranges
                ]
            )
            if any(part is None for part in mine):  # our own copy went bad meanwhile
                return True
            got = await ask(self.open_stream, peer, q.request(model_id, nonce), 32, self.timeout_s)
            return got == proof_digest(nonce, [p for p in mine if p is not None])
        self.asked["read"] += 1
        got = await ask(
            self.open_stream, peer, q.request(model_id, nonce), q.length, self.timeout_s
        )
        self.asked["read_bytes"] += len(got)
        return hashlib.sha256(got).digest() == q.sha256

    def _later(self, peer: str, c: _Claims, why: str) -> None:
        c.retry_at = trio.current_time() + c.backoff_s
        log.info("claim not proven yet: asking again", peer=peer, why=why, retry_s=c.backoff_s)
        c.backoff_s = min(c.backoff_s * 2, MAX_RETRY_S)

    def condemn(self, peer: str, why: str) -> None:
        """``peer`` was caught lying elsewhere (a download got wrong bytes from it)."""
        if not self.banned(peer):
            self._liar(peer, why)

    def _liar(self, peer: str, why: str) -> None:
        self.liars[peer] = (trio.current_time() + LIAR_BAN_S, why)
        self.claims.pop(peer, None)
        self._due.discard(peer)
        self.version += 1
        log.warning(
            "peer lied about what it holds: out of the map and its records refused",
            peer=peer,
            why=why,
            ban_s=LIAR_BAN_S,
        )
        self.on_liar(peer, why)
