"""A gossip-level simulator of the coverage market: thousands of virtual nodes, the real decisions.

The market's decision code is pure, so a simulation can run exactly what a daemon runs:
every virtual node builds its CoverageRecord with ``compress``, the record is encoded
with ``to_wire`` + ``pack`` and validated with ``from_wire``, ``CoverageMap.check`` and
the ``RecordGate`` as every receiver would, applied to a real ``CoverageMap``, and the
node decides with the real ``decide`` against targets from a real ``Demand`` fed with
real ``LoadReport``s. Only the network and the clock are simulated (discrete events):

- **Latency.** A record reaches others after ``hops`` gossip hops (``log(N)/log(D)``
  for a gossipsub mesh of degree D), each hop lognormal around ``hop_latency_s``.
- **Loss.** With probability ``loss`` a viewer misses the latest records and sees them
  one heartbeat later, when the sender republishes its full state.
- **Churn.** Every ``churn_every_s`` a fraction ``churn`` of the nodes leaves without
  notice (no ``offline`` record) and as many new nodes boot. A holder that left is found
  by the peers connected to it (``observers`` of them, after the liveness timeout and
  their market heartbeat), which suspect it with the daemon's ``Suspicions`` delays: the
  first suspicion, and the others sent before it reached them, go out; every map then
  expires the holder's record within ``suspect_s``. Others expire by their TTL.
- **Heterogeneous nodes.** Budgets lognormal around ``budget_median``; download
  bandwidth lognormal (a unit is ``joining``/``loading`` until its bytes are in). Each
  node sizes its takes by its rate as the daemon measures it (``pacing.Bandwidth``, fed
  from its own simulated downloads), and enrolls against the daemon's spare targets
  (``with_spare`` of the market's budget); what is reported is measured against the
  targets themselves.
- **Publishing.** Each node runs the daemon's ``Publisher``: a record on change, a
  keep-alive every ``keepalive_s``, silence while it has nothing to tell.
- **Joining delays.** Nodes boot spread over ``boot_s`` (a model announcement reaching
  a running network), fetch the map from a peer (sync: counted, not gossip), listen
  ``LISTEN_HEARTBEATS`` heartbeats and wait a random
  enrollment delay, like ``MarketService``; afterwards they rebalance every
  ``rebalance_s`` (jittered), the next decision only after their download finished.
- **Load.** One stage per layer gossips a LoadReport every ``load_interval_s`` with
  expert selections drawn from a Zipf law per layer (exponent ``skew``), so hot experts
  get higher targets.

The approximation, and why. A full-mesh view per node costs N records per heartbeat
per node: 10,000 nodes would apply 2 x 10^7 records per simulated second in Python.
The simulator keeps **one** real CoverageMap, the map every honest node converges to
(records applied when published, expired by the real TTL), and keeps snapshots of its
replica counts. A node deciding at time t sees the snapshot of ``t - delay``, with its
delay drawn per decision from the latency and loss model above; so nodes deciding within
one latency of each other do not see each other's ``joining`` announcements and may pile
onto the same units, which is the race the random delay, the random run order and the
joining state exist for. What this does not capture: two viewers missing *different*
records at the same moment (loss here delays the whole view by a heartbeat, which is
pessimistic), and a live peer expiring from one viewer's map after three lost keep-alives
in a row (probability ``loss**3``, 10^-6 at 1%; gossipsub's IWANT recovery makes it
rarer still); nor a false suspicion (a live holder's link failing), which its refutation
answers. ``holders(unit)`` (which ``decide`` uses to pick the designated surplus
holders) is answered from the same map through a range index that returns exactly what
``CoverageMap.holders`` returns, in O(ranges) numpy instead of O(peers) Python.

Gossip bytes are counted from the real encodings: each message's msgpack size, plus the
gossipsub envelope (protobuf Message with signer, seqno, topic, 64-byte signature and
public key, RPC framing, yamux and Noise framing), as gossipsub sends them with the
daemon's parameters (kvasird.p2p.gossip): every node but the publisher receives a copy
from each of its mesh peers but the one it forwarded it to first, ``d - 1`` copies for a
node of mesh degree ``d`` (drawn per node: D plus the grafts it accepted, up to D_high);
each node announces each id in GOSSIP_WINDOW heartbeats to GOSSIP_PEERS peers, so it
receives as many IHAVE ids a message, plus one IHAVE RPC's framing from each of those
peers in every heartbeat that had messages; and a GRAFT and a PRUNE for each mesh link a
churning node makes or breaks. (An IWANT follows only an id whose every mesh copy was
lost: ``loss ** (d - 1)``, 10^-6 at 1 %, left out.) What a node receives is reported per
node and minute, mean and 99th percentile over nodes and minutes.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass, field
from functools import cache

import numpy as np
from libp2p.pubsub.pb import rpc_pb2

from kvasird import PROTOCOL_VERSION, __version__
from kvasird.errors import WireError
from kvasird.market.coverage import Counts, CoverageMap
from kvasird.market.demand import Demand, Targets, fully_covered, with_spare
from kvasird.market.enroll import decide
from kvasird.market.gate import RecordGate, Stale
from kvasird.market.model import MarketModel
from kvasird.market.pacing import Bandwidth, joins_round, round_budget
from kvasird.market.publish import (
    SUSPECT_TTL_S,
    Publisher,
    Suspicions,
    census,
    keepalive_s,
    market_budget,
    participants,
    present,
    record_ttl,
    suspect_s,
)
from kvasird.market.records import (
    ACTIVE_STATES,
    MAX_RECORD_BYTES,
    Capabilities,
    CoverageRecord,
    Holding,
    LoadReport,
    Suspicion,
    compress,
)
from kvasird.market.service import LISTEN_HEARTBEATS
from kvasird.wire.protocols import COVERAGE_TOPIC, SUSPECT_TOPIC
from kvasird.model.manifest import Unit
from kvasird.p2p.gossip import (
    GOSSIP_PEERS,
    GOSSIP_WINDOW,
    MESH_DEGREE,
    MESH_DEGREE_HIGH,
)
from kvasird.wire import pack, unpack

MB = 10**6
GB = 10**9
EPOCH = 1_800_000_000.0
"""Simulated clock origin (unix seconds): seq and ts encode as they will on real nodes."""
PEER_ID_BYTES = 38
"""An Ed25519 libp2p peer id (identity multihash): the gossip message's ``from`` field."""
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def qwen122b(model_id: str = "5e" * 32) -> MarketModel:
    """The seeds' Qwen3.5-122B MoE as the market sees it: 49 layers x 256 experts, ~79 GB."""
    return MarketModel.uniform(model_id, n_layer=49, n_expert=256, layer_bytes=200 * MB,
                               expert_bytes=int(5.3 * MB), head_bytes=1 * GB)


@dataclass(frozen=True)
class SimConfig:
    nodes: int = 1000
    """Nodes at the start; churn keeps the population around this size."""
    duration_s: float = 1800.0
    """Simulated seconds."""
    seed: int = 0
    """Seed of every random draw: same config, same run."""
    target_replicas: int = 2
    """The network's base target per unit (hot experts get up to 3x)."""
    heartbeat_s: float = 5.0
    """The [market] heartbeat (default 5 s): keep-alives every KEEPALIVE_HEARTBEATS."""
    rebalance_s: float = 15.0
    """Seconds between a node's enrollment decisions, jittered x0.7..1.3."""
    enroll_delay_s: float = 10.0
    """Upper bound of the random delay before a node's first decision."""
    boot_s: float = 60.0
    """The initial nodes start spread uniformly over this many seconds."""
    budget_median: float = 2 * GB
    """Median memory budget in bytes (lognormal)."""
    budget_sigma: float = 1.0
    """Sigma of the budget's lognormal (1.0: a tenth of nodes hold 3.6x the median)."""
    budget_max: float = 64 * GB
    """Budgets are capped here (a big GPU box)."""
    bandwidth_median: float = 25 * MB
    """Median shard download rate in bytes/s (lognormal, sigma 0.7)."""
    hop_latency_s: float = 0.1
    """Median latency of one gossip hop (lognormal, sigma 0.5)."""
    loss: float = 0.01
    """Probability that a viewer misses the latest records until the next heartbeat."""
    churn: float = 0.05
    """Fraction of the nodes leaving (silently) at each churn event; as many arrive."""
    churn_every_s: float = 60.0
    """Seconds between churn events (the first one after this long)."""
    observers: int = 64
    """Peers connected to each node ([p2p] max_peers): those that see it fail."""
    liveness_timeout_s: float = 15.0
    """[p2p] liveness_timeout_s: a dead peer's connection is dropped this long after."""
    liveness_interval_s: float = 5.0
    """[p2p] heartbeat_interval_s."""
    skew: float = 1.0
    """Zipf exponent of expert selection per layer; 0 = uniform load (no hot experts)."""
    load_interval_s: float = 60.0
    """Seconds between each stage's LoadReport."""
    tokens_per_min: int = 20_000
    """Tokens routed through each layer per minute (each selects top_k experts)."""
    top_k: int = 8
    """Experts selected per token per layer."""
    mesh_degree: int = MESH_DEGREE
    """gossipsub D (kvasird.p2p.gossip): mesh peers each message is forwarded to."""
    mesh_degree_high: int = MESH_DEGREE_HIGH
    """gossipsub D_high: the most mesh peers a node keeps."""
    gossip_window: int = GOSSIP_WINDOW
    """gossipsub heartbeats whose message ids are announced in IHAVE."""
    gossip_peers: int = GOSSIP_PEERS
    """Peers each node sends its IHAVE to, each heartbeat."""
    sample_s: float = 5.0
    """Seconds between samples of the coverage time series."""


@dataclass(frozen=True)
class Sample:
    t: float
    """Simulated seconds since start."""
    covered: float
    """Fraction of units at their target, counting joining/loading/online holders."""
    online: float
    """Fraction of units at their target with online holders only."""
    nodes: int
    """Live nodes."""
    holding: int
    """Live nodes that hold at least one unit."""


@dataclass(frozen=True)
class Gossip:
    """Control-plane traffic, network-wide per minute and what one node receives of it."""

    records_per_min: float
    """Coverage records published per minute by the whole network."""
    changes_per_min: float
    """Of which carry a change (the rest are keep-alives and refutations)."""
    suspicions_per_min: float
    """Suspicions published per minute."""
    record_bytes: float
    """Mean msgpack size of a coverage record."""
    envelope_bytes: float
    """Mean gossipsub + yamux + Noise bytes around one record."""
    unique_per_node_min: float
    """Bytes of one copy of every coverage, suspicion and load message, per minute."""
    mesh_per_node_min: float
    """Bytes a node of mean mesh degree receives as mesh copies, per minute."""
    ihave_per_node_min: float
    """Bytes of IHAVE (ids and RPC framing) a node receives per minute."""
    control_per_node_min: float
    """GRAFT/PRUNE bytes a node receives per minute (mesh repair after churn)."""
    load_per_min: float
    """LoadReport bytes per minute (one copy)."""
    change_bytes: float
    """Mean bytes (record + envelope) of a record that changes."""
    p99_per_node_min: float
    """99th percentile over nodes and minutes of what a node receives."""

    @property
    def total_per_node_min(self) -> float:
        return self.mesh_per_node_min + self.ihave_per_node_min + self.control_per_node_min


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    """What was simulated."""
    samples: tuple[Sample, ...]
    """The coverage time series."""
    t_covered: float | None
    """First time every unit was at its target (active holders), None if never."""
    t_online: float | None
    """First time every unit was at its target with online holders, None if never."""
    expert_replicas: np.ndarray
    """Active replicas per expert at the end, [n_layer, n_expert]."""
    expert_targets: np.ndarray
    """Targets per expert at the end (from the load)."""
    layer_replicas: np.ndarray
    """Active replicas per layer's dense path at the end."""
    head_replicas: int
    """Active replicas of the head at the end."""
    gossip: Gossip
    """Traffic over the second half of the run (steady state)."""
    gossip_peak_per_node_min: float
    """What a node of mean mesh degree receives in the busiest minute (boot included)."""
    online_after_churn: tuple[float, ...]
    """Fraction of units at target with online holders that are really alive, 60 s after
    each churn event (just before the next)."""
    servable_after_churn: tuple[float, ...]
    """Fraction of units with at least one online holder that is alive, at the same times."""
    sync_bytes_per_join: float
    """Bytes a starting node fetches to learn the map (two syncs of every signed record)."""
    map_bytes: int
    """Python memory of one node's map (CoverageMap of freshly decoded records, plus the
    signed messages a daemon keeps for sync), at the end."""
    decisions: int
    """decide() calls (decisions skipped on a fully covered view not counted)."""
    decide_s: float
    """CPU seconds spent in decide()."""
    validate_us: float
    """Mean CPU microseconds to decode and validate a changed record (from_wire, check)."""
    apply_us: float
    """Mean CPU microseconds of CoverageMap.apply per record (what each receiver pays)."""
    max_holdings: int
    """Most ranges in one record."""
    max_record_bytes: int
    """Largest record (msgpack bytes)."""
    rejected: int
    """Records honest receivers would refuse (limits, budget); must be 0."""
    over_budget: int
    """Nodes holding more than their budget at the end; must be 0."""
    left: int
    """Nodes that left silently."""
    arrived: int
    """Nodes that joined after the start."""
    wall_s: float
    """Wall seconds the simulation took."""


@dataclass(slots=True)
class _Node:
    """A virtual node: what a MarketService holds in its attributes."""

    peer: str
    """Its peer id (base58, as long as a real Ed25519 one)."""
    budget: int
    """Memory budget, bytes."""
    bandwidth: float
    """Shard download rate, bytes/s (drawn)."""
    measured: Bandwidth = field(default_factory=Bandwidth)
    """Its rate as the daemon measures it, from its simulated downloads."""
    loading: tuple[int, float] = (0, 0.0)
    """Bytes and start of the download in flight."""
    held: dict[Unit, str] = field(default_factory=dict)
    """Units held and their state, as MarketService.held."""
    state: str = "joining"
    """Node state in its record."""
    seq: int = 0
    """Last sequence number published."""
    record: CoverageRecord | None = None
    """Last record published (None until the first, or after a refused one)."""
    wire_bytes: int = 0
    """msgpack size of that record."""
    alive: bool = True
    """False once it left (silently)."""
    publisher: Publisher = field(default_factory=lambda: Publisher(0.0))
    """The daemon's publish policy, as MarketService.publisher."""
    beat: float = math.inf
    """When its next keep-alive check is scheduled (inf: none pending)."""
    degree: int = MESH_DEGREE
    """Its gossipsub mesh degree."""


class _Holders:
    """Active holders per unit as numpy range arrays; answers like CoverageMap.holders."""

    _KIND = {"H": 0, "L": 1, "E": 2}

    def __init__(self) -> None:
        self._rows: dict[str, np.ndarray] = {}
        self._table: tuple[np.ndarray, list[str]] | None = None

    def set(self, peer: str, holdings: tuple[Holding, ...]) -> None:
        rows = [(self._KIND[h.kind], h.start, h.lo, h.hi) for h in holdings
                if h.state in ACTIVE_STATES]
        if rows:
            self._rows[peer] = np.array(rows, dtype=np.int32)
        else:
            self._rows.pop(peer, None)
        self._table = None

    def remove(self, peer: str) -> None:
        if self._rows.pop(peer, None) is not None:
            self._table = None

    def __call__(self, unit: Unit) -> list[str]:
        if self._table is None:
            peers = list(self._rows)
            if not peers:
                return []
            rows = np.concatenate([self._rows[p] for p in peers])
            owner = np.repeat(np.arange(len(peers)), [len(self._rows[p]) for p in peers])
            self._table = (np.column_stack([rows, owner]), peers)
        table, peers = self._table
        k, s, lo, hi, owner = table.T
        if unit.kind == "head":
            hit = k == 0
        elif unit.kind == "layer":
            hit = (k == 1) & (lo <= unit.layer) & (unit.layer < hi)
        else:
            hit = (k == 2) & (s == unit.layer) & (lo <= unit.expert) & (unit.expert < hi)
        return [peers[i] for i in np.unique(owner[hit])]


@cache
def envelope_bytes(data_len: int, topic: str = f"kvasir/mainnet/{COVERAGE_TOPIC}") -> int:
    """Bytes around a gossip payload of ``data_len``: pubsub Message + RPC, yamux, Noise."""
    msg = rpc_pb2.Message(from_id=b"\0" * PEER_ID_BYTES, data=b"\0" * data_len,
                          seqno=b"\0" * 8, topicIDs=[topic], signature=b"\0" * 64,
                          key=b"\0" * 36)
    rpc = len(rpc_pb2.RPC(publish=[msg]).SerializeToString())
    varint = 1 if rpc < 128 else 2 if rpc < 16384 else 3
    return rpc - data_len + varint + 12 + 16 + 2  # length prefix, yamux header, Noise tag+len


IHAVE_ID_BYTES = PEER_ID_BYTES + 8 + 2
"""One message id in an IHAVE (signer + seqno, protobuf framing)."""
IHAVE_RPC_BYTES = 2 + 2 + 24 + 3 + 12 + 16 + 2
"""An IHAVE RPC's framing: control, ihave, topic, length prefix, yamux, Noise."""
CONTROL_BYTES = 2 + 2 + 24 + 3 + 12 + 16 + 2
"""A GRAFT or PRUNE RPC (a topic and framing)."""
_BIN = {k: i for i, k in enumerate((
    "records", "changes", "record_bytes", "envelope_bytes", "load_bytes", "change_bytes",
    "suspicions", "messages", "unique", "control"))}


class MarketSim:
    """Run with ``MarketSim(config, model).run()``; see the module docstring."""

    def __init__(self, config: SimConfig, model: MarketModel | None = None) -> None:
        self.cfg = config
        self.model = model or qwen122b()
        self.rng = np.random.default_rng(config.seed)
        self.truth = CoverageMap(self.model)
        self.gate = RecordGate()
        self.index = _Holders()
        self.demand = Demand(self.model)
        self.targets = self.demand.targets(config.target_replicas)
        self.nodes: list[_Node] = []
        self.by_peer: dict[str, _Node] = {}
        self.events: list[tuple[float, int, str, int]] = []
        self._n_events = 0
        self._snap_t: deque[float] = deque()
        self._snap: deque[Counts] = deque()
        self._dirty = True
        # each node forwards to its mesh peers but the one it heard the message from
        self._hops = max(1, math.ceil(math.log(max(config.nodes, 2))
                                      / math.log(max(config.mesh_degree - 1, 2))))
        self._keepalive = keepalive_s(config.heartbeat_s)
        self._popularity = self._zipf()
        self._bins: dict[int, np.ndarray] = {}
        """Per-minute traffic, columns _BIN."""
        self._busy: dict[int, set[int]] = {}
        """Per minute, the seconds in which messages were published (IHAVE heartbeats)."""
        self._census: tuple[int, int, list[float], int] = (-1, 0, [], 0)
        self._entries_version = 0
        self.online_after: list[float] = []
        self.servable_after: list[float] = []
        self.sync_bytes: list[int] = []
        self.samples: list[Sample] = []
        self.decisions = 0
        self.decide_s = 0.0
        self.max_holdings = 0
        self.max_record_bytes = 0
        self.rejected = 0
        self.validate_s = self.apply_s = 0.0
        self.validated = self.applied = 0
        self.left = 0
        self.arrived = 0

    # --- the event loop -----------------------------------------------------------------

    def at(self, t: float, kind: str, node: int = -1) -> None:
        self._n_events += 1
        heapq.heappush(self.events, (t, self._n_events, kind, node))

    def run(self) -> SimResult:
        started = time.perf_counter()
        cfg = self.cfg
        for _ in range(cfg.nodes):
            self.at(float(self.rng.uniform(0, cfg.boot_s)), "boot", self._new_node())
        self.at(0.0, "sample")
        self.at(1.0, "expire")
        if cfg.tokens_per_min > 0:
            self.at(cfg.load_interval_s / 2, "load")
        if cfg.churn > 0:
            self.at(cfg.churn_every_s, "churn")
        handlers = {"boot": self._boot, "beat": self._beat, "decide": self._decide,
                    "loaded": self._loaded, "expire": self._expire, "sample": self._sample,
                    "load": self._load, "churn": self._churn, "probe": self._probe,
                    "suspect": self._suspect}
        while self.events and self.events[0][0] <= cfg.duration_s:
            t, _, kind, node = heapq.heappop(self.events)
            self._snapshot(t)
            handlers[kind](t, node)
        return self._result(time.perf_counter() - started)

    # --- nodes --------------------------------------------------------------------------

    def _new_node(self) -> int:
        cfg = self.cfg
        spread = math.exp(cfg.budget_sigma * self.rng.normal())
        budget = min(cfg.budget_max, cfg.budget_median * spread)
        peer = "12D3KooW" + "".join(_B58[i] for i in self.rng.integers(0, 58, 44))
        degree = cfg.mesh_degree + int(self.rng.binomial(cfg.mesh_degree_high - cfg.mesh_degree,
                                                         0.25))
        node = _Node(peer, int(budget), cfg.bandwidth_median * math.exp(0.7 * self.rng.normal()),
                     publisher=Publisher(self._keepalive), degree=degree)
        self.nodes.append(node)
        self.by_peer[peer] = node
        return len(self.nodes) - 1

    def _boot(self, t: float, i: int) -> None:
        self._publish(t, i)
        listen = self.cfg.heartbeat_s * LISTEN_HEARTBEATS
        self.at(t + listen + float(self.rng.uniform(0, self.cfg.enroll_delay_s)), "decide", i)

    def _beat(self, t: float, i: int) -> None:
        node = self.nodes[i]
        node.beat = math.inf
        if not node.alive:
            return
        self._publish(t, i)
        if node.beat == math.inf and node.publisher.at > -math.inf:  # not due: it moved
            node.beat = max(node.publisher.next_at(), t + self.cfg.heartbeat_s)
            self.at(node.beat, "beat", i)

    def _decide(self, t: float, i: int) -> None:
        node = self.nodes[i]
        if not node.alive:
            return
        view = self._view(t)
        plan_add: tuple[Unit, ...] = ()
        held_bytes = sum(self.model.size(u) for u in node.held)
        targets = with_spare(self.targets, self.model, self._market_budget())
        rate = node.measured.rate
        if not fully_covered(view, targets) and joins_round(
                self.model, view, targets, self._peers(), node.budget, rate,
                self.cfg.rebalance_s, self.cfg.heartbeat_s, self.rng):
            began = time.process_time()
            plan = decide(self.model, view, targets, node.peer,
                          round_budget(self.model, node.budget, held_bytes, rate),
                          set(node.held), set(), self.index, self.rng,
                          peers=self._peers())
            self.decide_s += time.process_time() - began
            self.decisions += 1
            if plan.drop:
                for u in plan.drop:
                    node.held[u] = "draining"
                self._publish(t, i)
                for u in plan.drop:
                    del node.held[u]
            plan_add = plan.add
            if plan.add:
                for u in plan.add:
                    node.held[u] = "joining"
                self._publish(t, i)
                for u in plan.add:
                    node.held[u] = "loading"
                size = sum(self.model.size(u) for u in plan.add)
                node.loading = (size, t)
                self.at(t + size / node.bandwidth, "loaded", i)
            elif plan.drop:
                self._publish(t, i)
        if node.state != "online":
            node.state = "online"
            if not plan_add:
                self._publish(t, i)
        if not plan_add:
            self.at(t + self._rebalance_wait(), "decide", i)

    def _silent(self) -> tuple[int, list[float]]:
        """``census`` of the map, recomputed when the map's peers changed."""
        self._recount()
        return self._census[1], self._census[2]

    def _market_budget(self) -> int:
        """``market_budget`` of the map, recomputed with the census."""
        self._recount()
        return self._census[3]

    def _recount(self) -> None:
        if self._census[0] != self._entries_version:
            records = [e.record for e in self.truth.entries.values()]
            tellers, silent = census(records)
            self._census = (self._entries_version, tellers, silent,
                            market_budget(records, participants(tellers, silent)))

    def _peers(self) -> int:
        return participants(*self._silent())

    def _loaded(self, t: float, i: int) -> None:
        node = self.nodes[i]
        if not node.alive:
            return
        for u, state in node.held.items():
            if state == "loading":
                node.held[u] = "online"
        size, began = node.loading
        node.measured.observe(size, t - began)
        self._publish(t, i)
        self.at(t + self._rebalance_wait(), "decide", i)

    def _rebalance_wait(self) -> float:
        return self.cfg.rebalance_s * float(self.rng.uniform(0.7, 1.3))

    def _churn(self, t: float, _: int) -> None:
        """A churn event: a fraction of the nodes leaves silently, as many boot."""
        cfg = self.cfg
        alive = [i for i, n in enumerate(self.nodes) if n.alive]
        leaving = self.rng.choice(alive, int(round(cfg.churn * len(alive))), replace=False)
        for i in leaving:
            node = self.nodes[int(i)]
            node.alive = False
            self.left += 1
            entry = self.truth.entries.get(node.peer)
            if entry is not None and node.held and entry.record.ttl > SUSPECT_TTL_S:
                self._observe_failure(t, int(i))
        for _ in leaving:
            self.arrived += 1
            self.at(t, "boot", self._new_node())
        # each joiner fetches the map by sync (twice, as MarketService), not by waiting
        # for keep-alives: every signed record, the map's peers'
        mapped = [self.by_peer[p].wire_bytes for p in self.truth.entries]
        self.sync_bytes.append(2 * sum(b + envelope_bytes(b) for b in mapped))
        # each link of the leavers' meshes is repaired: a PRUNE (timeout) and a GRAFT
        row = self._row(t)
        row[_BIN["control"]] += 2 * sum(self.nodes[int(i)].degree for i in leaving)
        self.at(t + cfg.churn_every_s - 1e-6, "probe")
        self.at(t + cfg.churn_every_s, "churn")

    def _observe_failure(self, t: float, i: int) -> None:
        """The peers connected to a holder that left see its connection fail, each after
        the liveness timeout, and tell with the daemon's suspicion delay; those whose
        turn comes before the first suspicion reached them publish too."""
        cfg, node = self.cfg, self.nodes[i]
        delays = Suspicions(spread_s=cfg.heartbeat_s)
        seen = np.array([cfg.liveness_timeout_s + float(self.rng.uniform(0, cfg.liveness_interval_s))
                         + float(self.rng.uniform(0, cfg.heartbeat_s)) + delays.delay(self.rng)
                         for _ in range(min(cfg.observers, max(cfg.nodes - 1, 1)))])
        first = float(seen.min())
        reach = self._propagation()
        assert node.record is not None
        for _ in range(int((seen < first + reach).sum())):
            self._count_suspicion(t + first, node)
        self.at(t + first + reach, "suspect", i)

    def _propagation(self) -> float:
        return float(self.rng.lognormal(math.log(self.cfg.hop_latency_s), 0.5, self._hops).sum())

    def _suspect(self, t: float, i: int) -> None:
        node = self.nodes[i]
        if node.record is not None:
            self.truth.suspect(node.peer, node.record.seq, t + suspect_s(self.cfg.heartbeat_s))

    # --- gossip -------------------------------------------------------------------------

    def _publish(self, t: float, i: int) -> None:
        """The node builds its record; when its Publisher says it is due, every receiver
        validates it and applies it. Its next keep-alive is scheduled."""
        node = self.nodes[i]
        node.seq = max(node.seq + 1, int((EPOCH + t) * 1000))
        peers = self._peers()
        node.publisher.keepalive_s = keepalive_s(self.cfg.heartbeat_s, peers)
        record = CoverageRecord(
            peer=node.peer, seq=node.seq, ts=EPOCH + t, state=node.state,
            ttl=record_ttl(self.cfg.heartbeat_s, peers),
            protocol=PROTOCOL_VERSION, version=__version__,
            addrs=(f"/ip4/203.0.113.{i % 250}/tcp/4001/p2p/{node.peer}",
                   f"/ip4/203.0.113.{i % 250}/tcp/4002/ws/p2p/{node.peer}"),
            model=self.model.model_id if node.held else "", budget=node.budget,
            holdings=compress(node.held), caps=Capabilities())
        node.publisher.present = present(node.peer, self._silent()[1])
        if not node.publisher.due(record, t):
            return
        changed = node.publisher.changed(record)
        node.publisher.sent(record, t)
        if node.beat == math.inf:
            node.beat = node.publisher.next_at()
            self.at(node.beat, "beat", i)
        data = pack(record.to_wire())
        node.wire_bytes = len(data)
        self.max_holdings = max(self.max_holdings, len(record.holdings))
        self.max_record_bytes = max(self.max_record_bytes, len(data))
        began = time.process_time()
        try:
            if len(data) > MAX_RECORD_BYTES:
                raise WireError(f"record of {len(data)} bytes")
            record = CoverageRecord.from_wire(unpack(data, MAX_RECORD_BYTES))
            if record.model:
                self.truth.check(record)
        except WireError:
            self.rejected += 1
            node.record = None
            return
        finally:
            self.validate_s += time.process_time() - began
            self.validated += 1
        node.record = record
        self._count(t, len(data), changed)
        try:
            self.gate.check(COVERAGE_TOPIC, node.peer, node.peer, record.seq, record.ts, EPOCH + t)
        except Stale:
            return
        except WireError:
            self.rejected += 1
            return
        began = time.process_time()
        fresh = node.peer not in self.truth.entries
        self.truth.apply(record, t)
        self.apply_s += time.process_time() - began
        self.applied += 1
        self._entries_version += fresh or changed or node.peer not in self.truth.entries
        if changed:
            self.index.set(node.peer, record.holdings)
            self._dirty = True

    def _row(self, t: float) -> np.ndarray:
        return self._bins.setdefault(int(t // 60), np.zeros(len(_BIN)))

    def _message(self, t: float, size: int, topic: str) -> np.ndarray:
        """Count one message (payload ``size``) in its minute; the row, for more columns."""
        row = self._row(t)
        row[_BIN["messages"]] += 1
        row[_BIN["unique"]] += size + envelope_bytes(size, f"kvasir/mainnet/{topic}")
        self._busy.setdefault(int(t // 60), set()).add(int(t))
        return row

    def _count(self, t: float, size: int, changed: bool) -> None:
        row = self._message(t, size, COVERAGE_TOPIC)
        row[_BIN["records"]] += 1
        row[_BIN["record_bytes"]] += size
        row[_BIN["envelope_bytes"]] += envelope_bytes(size)
        if changed:
            row[_BIN["changes"]] += 1
            row[_BIN["change_bytes"]] += size + envelope_bytes(size)

    def _count_suspicion(self, t: float, node: _Node) -> None:
        assert node.record is not None
        s = Suspicion("12D3KooW" + "x" * 44, int((EPOCH + t) * 1000), EPOCH + t, node.peer,
                      node.record.seq)
        self._message(t, len(pack(s.to_wire())), SUSPECT_TOPIC)[_BIN["suspicions"]] += 1

    def _expire(self, t: float, _: int) -> None:
        for peer in self.truth.expire(t):
            self.gate.forget(peer)
            self.index.remove(peer)
            self._dirty = True
            self._entries_version += 1
        self.at(t + 1.0, "expire")

    # --- what a deciding node sees -------------------------------------------------------

    def _snapshot(self, t: float) -> None:
        """Keep the replica counts as they were at ``t`` (before this event).

        Snapshots are at least a tenth of a hop's latency apart (bounded memory), so
        the quantisation stays well below the delays being simulated.
        """
        spacing = 0.1 * self.cfg.hop_latency_s
        if self._dirty and (not self._snap_t or t - self._snap_t[-1] >= spacing):
            active = self.truth.active
            self._snap_t.append(t)
            self._snap.append(Counts(active.layer.copy(), active.expert.copy(), active.head))
            self._dirty = False
            horizon = t - (self.cfg.heartbeat_s + 10 * self.cfg.hop_latency_s * self._hops)
            while len(self._snap_t) > 1 and self._snap_t[1] <= horizon:
                self._snap_t.popleft()
                self._snap.popleft()

    def _view(self, t: float) -> Counts:
        """The counts a node deciding at ``t`` has received: latency and loss delayed."""
        delay = float(self.rng.lognormal(math.log(self.cfg.hop_latency_s), 0.5, self._hops).sum())
        if self.rng.random() < self.cfg.loss:
            delay += self.cfg.heartbeat_s
        if not self._snap:
            return self.truth.active
        return self._snap[max(0, bisect.bisect_right(self._snap_t, t - delay) - 1)]

    # --- load ---------------------------------------------------------------------------

    def _zipf(self) -> np.ndarray:
        """Selection probability per expert, [n_layer, n_expert]: Zipf over a random order."""
        n_layer, n_expert = self.model.n_layer, self.model.n_expert
        weights = 1.0 / np.arange(1, n_expert + 1) ** self.cfg.skew
        out = np.empty((n_layer, n_expert))
        for layer in range(n_layer):
            out[layer, self.rng.permutation(n_expert)] = weights / weights.sum()
        return out

    def _load(self, t: float, _: int) -> None:
        """Each layer's stage reports the experts its tokens selected, through Demand."""
        cfg = self.cfg
        picks = int(cfg.tokens_per_min * cfg.load_interval_s / 60) * cfg.top_k
        for layer in range(self.model.n_layer):
            counts = self.rng.multinomial(picks, self._popularity[layer])
            report = LoadReport(
                peer=f"stage-{layer}", seq=int((EPOCH + t) * 1000), ts=EPOCH + t,
                model=self.model.model_id, window_s=cfg.load_interval_s,
                tokens=picks // cfg.top_k,
                experts=tuple((layer, int(e), int(c)) for e, c in enumerate(counts) if c))
            size = len(pack(report.to_wire()))
            self._message(t, size, "load")[_BIN["load_bytes"]] += size + envelope_bytes(
                size, "kvasir/mainnet/load")
            self.demand.add(report, t)
        self.targets = self.demand.targets(cfg.target_replicas)
        self.at(t + cfg.load_interval_s, "load")

    # --- measurements -------------------------------------------------------------------

    def _sample(self, t: float, _: int) -> None:
        alive = [n for n in self.nodes if n.alive]
        self.samples.append(Sample(
            t, covered_fraction(self.truth.active, self.targets),
            covered_fraction(self.truth.online, self.targets), len(alive),
            sum(1 for n in alive if n.held)))
        self.at(t + self.cfg.sample_s, "sample")

    def _probe(self, t: float, _: int) -> None:
        """Units at target with online holders that are alive (not what the maps say)."""
        counts = Counts.zeros(self.model)
        for n in self.nodes:
            if n.alive and n.record is not None:  # its record is published on every change
                for h in n.record.holdings:
                    if h.state == "online":
                        counts.add(h, +1)
        self.online_after.append(covered_fraction(counts, self.targets))
        self.servable_after.append(covered_fraction(counts, self.demand.targets(1)))

    def _received(self, row: np.ndarray, minute: int, degree: float) -> float:
        """Bytes a node of mesh ``degree`` receives in a minute of traffic ``row``."""
        cfg = self.cfg
        ihave = cfg.gossip_peers * (cfg.gossip_window * row[_BIN["messages"]] * IHAVE_ID_BYTES
                                    + len(self._busy.get(minute, ())) * IHAVE_RPC_BYTES)
        control = row[_BIN["control"]] * CONTROL_BYTES / max(len(self.nodes) - self.left, 1)
        return (degree - 1) * row[_BIN["unique"]] + ihave + control

    def _gossip(self, minutes: list[int]) -> Gossip:
        cfg = self.cfg
        rows = np.array([self._bins.get(m, np.zeros(len(_BIN))) for m in minutes])
        mean = rows.mean(axis=0)
        c = {k: mean[v] for k, v in _BIN.items()}
        degree = float(np.mean([n.degree for n in self.nodes]))
        ihave = cfg.gossip_peers * (cfg.gossip_window * c["messages"] * IHAVE_ID_BYTES + np.mean(
            [len(self._busy.get(m, ())) for m in minutes]) * IHAVE_RPC_BYTES)
        control = c["control"] * CONTROL_BYTES / max(len(self.nodes) - self.left, 1)
        degrees = np.array([n.degree for n in self.nodes if n.alive])
        per_node = [self._received(row, m, d) for m, row in zip(minutes, rows)
                    for d in np.percentile(degrees, np.arange(0.5, 100, 1.0))]
        return Gossip(
            records_per_min=c["records"], changes_per_min=c["changes"],
            suspicions_per_min=c["suspicions"],
            record_bytes=c["record_bytes"] / max(c["records"], 1),
            envelope_bytes=c["envelope_bytes"] / max(c["records"], 1),
            unique_per_node_min=c["unique"], mesh_per_node_min=c["unique"] * (degree - 1),
            ihave_per_node_min=ihave, control_per_node_min=control,
            load_per_min=c["load_bytes"], change_bytes=c["change_bytes"] / max(c["changes"], 1),
            p99_per_node_min=float(np.percentile(per_node, 99)))

    def _map_bytes(self) -> int:
        """One node's map as a daemon holds it: records decoded from the wire (fresh
        objects, as a receiver has them) in a CoverageMap, and the signed messages."""
        tracemalloc.start()
        try:
            view = CoverageMap(self.model)
            signed = {}
            for peer, e in self.truth.entries.items():
                data = pack(e.record.to_wire())
                view.apply(CoverageRecord.from_wire(unpack(data, MAX_RECORD_BYTES)), 0.0)
                signed[peer] = bytes(len(data) + envelope_bytes(len(data)))
            return tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    def _result(self, wall_s: float) -> SimResult:
        cfg = self.cfg
        last = int(cfg.duration_s // 60)
        steady = list(range(max(0, last // 2), max(1, last)))
        peak = max((self._gossip([m]).total_per_node_min for m in self._bins), default=0.0)
        over = sum(1 for n in self.nodes if n.alive
                   and sum(self.model.size(u) for u in n.held) > n.budget)
        return SimResult(
            config=cfg, samples=tuple(self.samples),
            t_covered=next((s.t for s in self.samples if s.covered >= 1.0), None),
            t_online=next((s.t for s in self.samples if s.online >= 1.0), None),
            expert_replicas=self.truth.active.expert.copy(),
            expert_targets=self.targets.expert.copy(),
            layer_replicas=self.truth.active.layer.copy(), head_replicas=self.truth.active.head,
            gossip=self._gossip(steady), gossip_peak_per_node_min=peak,
            online_after_churn=tuple(self.online_after),
            servable_after_churn=tuple(self.servable_after),
            sync_bytes_per_join=float(np.mean(self.sync_bytes)) if self.sync_bytes else 0.0,
            map_bytes=self._map_bytes(),
            decisions=self.decisions, decide_s=self.decide_s,
            validate_us=1e6 * self.validate_s / max(self.validated, 1),
            apply_us=1e6 * self.apply_s / max(self.applied, 1), max_holdings=self.max_holdings,
            max_record_bytes=self.max_record_bytes, rejected=self.rejected, over_budget=over,
            left=self.left, arrived=self.arrived, wall_s=wall_s)


def covered_fraction(counts: Counts, targets: Targets) -> float:
    """Fraction of all units (head, layers, experts) at or above their target."""
    ok = int(counts.head >= targets.head) + int((counts.layer >= targets.layer).sum())
    ok += int((counts.expert >= targets.expert).sum())
    return ok / (1 + targets.layer.size + targets.expert.size)


def simulate(config: SimConfig, model: MarketModel | None = None) -> SimResult:
    return MarketSim(config, model).run()
