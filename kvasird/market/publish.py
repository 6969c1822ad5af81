"""When a node publishes its coverage record, and how a dead holder leaves the maps. Pure.

Every node once published its whole record every heartbeat (records lived 3 heartbeats):
gossip per node and minute grew with the network (bench/sim_market.py measures it).
Now a record goes out

- **on change**: anything in it but its sequence number and time (holdings and their
  states, node state, addresses, wallet link, reachability, the model's name, ...): a
  model renamed with `kvasird model add --name` is told at the next heartbeat, signed
  like the rest of the record (gossipsub's strict signing: the peer id is the signer);
- **as a keep-alive**, unchanged, every ``keepalive_s``: one heartbeat for each
  PEERS_PER_HEARTBEAT nodes taking part, between MIN_KEEPALIVE_HEARTBEATS (a handful of
  nodes, where records are cheap and a lost one should be repaired within seconds) and
  KEEPALIVE_HEARTBEATS (5 minutes at the default 5 s heartbeat, from 960 nodes on), so
  the keep-alives a node receives stop growing with the network; its TTL is
  TTL_KEEPALIVES keep-alives (carried in the record), so two lost in a row do not drop a
  live holder;
- **as a refutation**, at once, when a peer suspects this node (below);
- **to supersede**, at once, when a peer's map holds this node's record of a previous run
  (a restart): its old holdings would count as covered until their TTL (minutes in a large
  market) while the node, holding nothing now, stayed silent;
- **not at all** while it has nothing to tell: a node that holds nothing, links no wallet
  and stores no full copy is read by no one, so it stays silent, except the PRESENCE_K
  such nodes whose peer ids hash lowest (all of them in a network smaller than that).
  Their records let every map count the nodes taking part (``participants``: a
  k-minimum-values estimate, exact in small networks) at a cost that does not grow with
  the network. A node that has published tells its later changes (giving its units up,
  going offline) all the same.

A dead holder is not found by its silence (that would take the TTL) but by the peers
connected to it, whose liveness service drops the dead connection within seconds. Each
of them publishes a suspicion naming the holder's last sequence number after a random
delay of up to ``spread_s``, unless someone else's suspicion (or news from the holder)
arrives first, so a death costs about one message however many peers saw it. Every map
then lets the holder's record expire within ``suspect_s``; a live holder answers with a
newer record, which cancels the suspicion everywhere.

The same census sizes the market's memory (``market_budget``): the budgets of the nodes
that tell something are all in the map, and the silent ones' are extrapolated from the
PRESENCE_K that publish, so whether the market has room for a spare replica
(``demand.with_spare``) is known at a cost that does not grow with the network either.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from kvasird.market.records import CoverageRecord

KEEPALIVE_HEARTBEATS = 60
"""Most heartbeats between keep-alives of an unchanged record."""
MIN_KEEPALIVE_HEARTBEATS = 3
PEERS_PER_HEARTBEAT = 16
TTL_KEEPALIVES = 3
"""A record lives this many keep-alives without a newer one."""
MIN_TTL_S = 10.0
"""Never less: a sender starved for a few seconds by its own work (a node computing for
several clients on a small machine) must not drop out of every map (#24)."""
SUSPECT_HEARTBEATS = 1
MIN_SUSPECT_S = 4.0
"""A suspected holder has this long (at least) to answer with a newer record: a gossip
round trip on a loaded machine."""
SUSPECT_TTL_S = 60.0
"""Holders whose records live longer than this are suspected when they fail; shorter ones
(a small market's fast keep-alives) leave the maps by their TTL soon enough, and a loaded
machine's flapping connections then cost no suspicions and refutations."""
PRESENCE_K = 64
"""Silent nodes that publish all the same: the ones with the lowest peer-id hashes."""


def keepalive_s(heartbeat_s: float, participants: int = 1 << 30) -> float:
    """Seconds between keep-alives of an unchanged record, in a market of ``participants``."""
    beats = min(
        KEEPALIVE_HEARTBEATS, max(MIN_KEEPALIVE_HEARTBEATS, participants // PEERS_PER_HEARTBEAT)
    )
    return heartbeat_s * beats


def record_ttl(heartbeat_s: float, participants: int = 1 << 30) -> float:
    """Seconds a coverage record stays valid without a newer one."""
    return max(keepalive_s(heartbeat_s, participants) * TTL_KEEPALIVES, MIN_TTL_S)


def suspect_s(heartbeat_s: float) -> float:
    """Seconds a suspected holder's record lives on, for it to answer."""
    return max(heartbeat_s * SUSPECT_HEARTBEATS, MIN_SUSPECT_S)


def rank(peer: str) -> float:
    """The peer id's hash as a fraction in [0, 1): uniform over peers, the same everywhere."""
    return int.from_bytes(hashlib.sha256(peer.encode()).digest()[:8], "big") / 2.0**64


def tells(record: CoverageRecord) -> bool:
    """Whether the record says something someone reads: holdings, a wallet, a full copy."""
    return bool(record.holdings or record.link is not None or record.has_all)


def present(peer: str, silent: list[float]) -> bool:
    """Whether a silent ``peer`` is one of the PRESENCE_K that publish, given the ranks of
    the silent records its map holds (sorted; its own excluded or not)."""
    mine = rank(peer)
    return bisect.bisect_left(silent, mine) < PRESENCE_K


def participants(tellers: int, silent: list[float]) -> int:
    """Nodes taking part: the ``tellers`` (records that tell something) plus the silent
    ones, counted while there are few and estimated from the PRESENCE_K-th lowest rank
    (k-minimum values: (k - 1) / rank_k, within about 1/sqrt(k) = 13 %) beyond."""
    if len(silent) < PRESENCE_K:
        return max(1, tellers + len(silent))
    return max(1, tellers + int((PRESENCE_K - 1) / silent[PRESENCE_K - 1]))


def census(records: list[CoverageRecord]) -> tuple[int, list[float]]:
    """(tellers, sorted ranks of the silent records): what ``present`` and ``participants``
    take."""
    silent = sorted(rank(r.peer) for r in records if not tells(r))
    return len(records) - len(silent), silent


def market_budget(records: list[CoverageRecord], participants: int) -> int:
    """Bytes the ``participants`` nodes offer to hold, from the records a map holds: the
    budgets of the nodes that tell something, all in the map, plus the silent nodes' (of
    which only the PRESENCE_K lowest ranks publish, a uniform sample) as the mean budget
    of those seen times the silent nodes ``participants`` counts."""
    told = [r.budget for r in records if tells(r)]
    silent = [r.budget for r in records if not tells(r)]
    out = float(sum(told))
    if silent:
        out += sum(silent) / len(silent) * max(len(silent), participants - len(told))
    return int(out)


@dataclass
class Publisher:
    """Decides, for the record a node has built now, whether it goes out."""

    keepalive_s: float
    """Seconds between keep-alives."""
    last: CoverageRecord | None = None
    """What was last published, sequence number and time blanked out."""
    at: float = -math.inf
    """When it was published."""
    ttl: float = math.inf
    """Its TTL: the next keep-alive goes out within it, however the interval grew."""
    refute: bool = False
    """A peer suspects us: the next record goes out whatever it holds."""
    supersede: bool = False
    """Peers hold our record of a previous run (we restarted): the next record goes out,
    silent or not, so their maps stop counting what we held then until its TTL ends."""
    present: bool = False
    """We are one of the silent nodes that publish (``present``); kept by the caller."""

    def due(self, record: CoverageRecord, now: float) -> bool:
        # a node still listening (its first decision ahead) does not count itself in yet
        speaks = tells(record) or (self.present and record.state != "joining")
        if self.supersede:
            return True
        if self.refute and (speaks or self.last is not None):
            return True
        if self.changed(record):
            return speaks or self.last is not None
        return speaks and now >= self.next_at()

    def changed(self, record: CoverageRecord) -> bool:
        """Whether ``record`` says anything the last one published did not."""
        return _content(record) != self.last

    def sent(self, record: CoverageRecord, now: float) -> None:
        self.last, self.at, self.ttl = _content(record), now, record.ttl
        self.refute = self.supersede = False

    def next_at(self) -> float:
        """When the next keep-alive is due (if nothing changes before)."""
        return self.at + min(self.keepalive_s, self.ttl / TTL_KEEPALIVES)


def _content(record: CoverageRecord) -> CoverageRecord:
    """What peers act on: no sequence number, time or TTL (which follows the market's size),
    and loading told as joining (both count as a replica, neither is routed to), so a
    download's start is one record."""
    holdings = tuple(
        dataclasses.replace(h, state="joining") if h.state == "loading" else h
        for h in record.holdings
    )
    return dataclasses.replace(record, seq=0, ts=0.0, ttl=0.0, holdings=holdings)


@dataclass
class Suspicions:
    """Failed peers this node saw, each waiting out its random delay before it is published."""

    spread_s: float
    """Upper bound of the random delay (a heartbeat)."""
    pending: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Suspect -> (its last sequence number we had, when we publish)."""

    def observed(self, peer: str, seq: int, now: float, rng: np.random.Generator) -> None:
        """``peer``, whose record we hold at ``seq``, failed under our eyes."""
        if peer not in self.pending:
            self.pending[peer] = (seq, now + self.delay(rng))

    def delay(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(0, self.spread_s))

    def settled(self, peer: str) -> None:
        """Someone else suspected it, or it spoke: nothing for us to say."""
        self.pending.pop(peer, None)

    def due(self, now: float) -> list[tuple[str, int]]:
        out = [(p, seq) for p, (seq, at) in self.pending.items() if at <= now]
        for p, _ in out:
            del self.pending[p]
        return out
