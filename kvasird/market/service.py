"""MarketService: gossip in and out, and the enrollment loop that drives this node's holdings.

Incoming records are decoded, validated and applied inside the gossipsub topic
validator, the one entry point for peer input: a record that fails is refused there,
which both keeps it out of the map and lowers the forwarder's gossipsub score.

Records go out on change and as slow keep-alives (``publish.Publisher``); a holder whose
connection fails under our eyes is suspected on the suspicion topic (``publish``'s
docstring). Since records are no longer resent every few seconds, a node that starts
fetches the map from a connected peer (the sync protocol): the latest signed gossip
message of each peer, checked like gossip, so a peer cannot forge what it relays. A node
that names its model by id learns the manifest from peers after that first fetch: records
that come before it knows its model are kept (``early``) and mapped once it does.

A node that stops says goodbye (``leave``): its loops end, then its record goes out as
offline while its peers are still connected, and every map drops it at once instead of
counting it until its TTL runs out. It goes out by gossip, for the whole network, and
to each connected peer over the goodbye protocol, which the peer answers once it has
applied the record: a connection closed right after a write loses what the peer had not
read yet (py-libp2p's muxer drops its buffers on the close), so a write alone is no proof.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import signature_validator

from kvasird import PROTOCOL_VERSION, __version__
from kvasird.config import MarketConfig
from kvasird.errors import ConfigError, WireError
from kvasird.logs import get_logger
from kvasird.market.coverage import CoverageMap
from kvasird.market.demand import Demand, fully_covered, segments, with_spare
from kvasird.market.enroll import decide
from kvasird.market.gate import RecordGate, Stale
from kvasird.market.model import MarketModel
from kvasird.market.pacing import Bandwidth, joins_round, round_budget
from kvasird.market.pinning import parse_hold
from kvasird.market.proofs import ClaimChecker
from kvasird.market.publish import (
    MIN_TTL_S,
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
    MAX_RECORD_BYTES,
    Capabilities,
    CoverageRecord,
    LoadReport,
    Suspicion,
    compress,
)
from kvasird.model.manifest import Manifest, Unit
from kvasird.model.names import agreed_name, named_by
from kvasird.p2p import P2PNode
from kvasird.p2p.streams import served
from kvasird.settlement.wallet import WalletLink

if TYPE_CHECKING:
    from kvasird.model.distribution import ShardService
from kvasird.wire import FrameReader, pack, unpack, write_frame
from kvasird.wire.protocols import (
    COVERAGE_TOPIC,
    GOODBYE_PROTOCOL,
    LOAD_TOPIC,
    SUSPECT_TOPIC,
    SYNC_PROTOCOL,
)

log = get_logger("kvasird.market")

SYNC_FRAME_BYTES = 512 * 1024
"""A sync answer is frames of signed messages, each frame up to about this many bytes."""
SYNC_TIMEOUT_S = 30.0
SYNC_PEERS = 1
"""Peers a starting node fetches the map from, each time (it fetches twice: once connected,
and again before its first decision, in case the first peer was as new as it is)."""
LISTEN_HEARTBEATS = 2
"""Heartbeats a node listens (and syncs) before its first enrollment decision."""
GOODBYE_TIMEOUT_S = 2.0
"""How long a stopping node waits for its peers to apply its offline record."""
__all__ = [
    "COVERAGE_TOPIC",
    "LOAD_TOPIC",
    "MIN_TTL_S",
    "SUSPECT_TOPIC",
    "MarketService",
    "record_ttl",
]
Loader = Callable[[list[Unit]], Awaitable[None]]


async def metadata_only(units: list[Unit]) -> None:
    """The loader while a node has no shard source: units count as held at once."""


class MarketService:
    def __init__(
        self,
        p2p: P2PNode,
        config: MarketConfig,
        model: MarketModel | None,
        caps: Capabilities,
        loader: Loader = metadata_only,
        seed: int | None = None,
        shards: ShardService | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.p2p = p2p
        self.clock = clock
        """Unix time (a test's virtual clock): records' times, TTLs and keep-alives."""
        self.config = config
        self.caps = caps
        self.boot = secrets.token_hex(8)
        """This process's start, in every record: peers forgive a restarted node's failures."""
        self.loader = loader
        self.shards = shards
        self.model: MarketModel | None = None
        self.name = ""
        """The model's name on the network, as this node's map tells it (``_agree_on_name``):
        what its gateway lists the model as."""
        self.map: CoverageMap | None = None
        self.demand: Demand | None = None
        self.budget = 0
        self.pinned = {u for pin in config.hold for u in parse_hold(pin)}
        if model is not None:
            self._use(model)
        self.announcers: dict[str, set[str]] = {}
        """Peers whose records name a model: where to fetch a manifest we lack."""
        self.names: dict[str, tuple[str, str]] = {}
        """Each peer's (model id, model name) as its latest record gave them: how a model
        configured by name is found before this node knows its id."""
        self.gate = RecordGate()
        self.held: dict[Unit, str] = {}
        self.state = "joining"
        self.link: WalletLink | None = None
        """This node's payout wallet link, published in its record (set by the daemon once
        settlement runs)."""
        self.rng = np.random.default_rng(seed)
        self._seq = 0
        self.participants = 1
        """Nodes taking part in the market, as our map counts them (``participants``)."""
        self.publisher = Publisher(keepalive_s(config.heartbeat_s, self.participants))
        self.suspicions = Suspicions(spread_s=config.heartbeat_s)
        self.bandwidth = Bandwidth()
        """This node's measured download rate: what a round's take is sized to."""
        self.signed: dict[str, bytes] = {}
        """Each mapped peer's latest record as its signed gossip message: what sync sends."""
        self.early: dict[str, tuple[CoverageRecord, float]] = {}
        """Records (with the time they count from) that came before this node knew its
        model: mapped once it does (``_map_early``)."""
        self.taking_part: trio.CancelScope | None = None
        """The market's loops, once they run: ``leave`` cancels them before it says goodbye."""
        self.left = trio.Event()
        """Set once the goodbye is out (or its time ran out)."""
        self.own: bytes | None = None
        """Our latest published record as its signed gossip message (from our own
        validator): what a goodbye hands to each peer."""
        self._connected: set[str] = set()
        self._wake = trio.Event()
        self.proofs: ClaimChecker | None = (
            None
            if shards is None
            else ClaimChecker(
                p2p.peer_id,
                shards.store,
                shards.open_stream,
                self._latest,
                self._caught_lying,
                np.random.default_rng(),
                on_pardon=lambda peer: self.p2p.gossip.unban(peer),
            )
        )
        """Checks what peers claim to hold before routing trusts it (None without a store:
        every claim is taken as it comes)."""

    def _use(self, model: MarketModel) -> None:
        self.model = model
        self.map = CoverageMap(model)
        self.demand = Demand(model)
        self.budget = self.config.memory_budget_mb * 1024 * 1024
        self._check_pins(model)
        self._agree_on_name()

    def _check_pins(self, model: MarketModel) -> None:
        """Refuse pins the model lacks or the budget cannot hold: peers refuse a record
        that claims more than its budget, so such a node would serve no one, and only
        their logs would say why."""
        where = f"{self.p2p.config_path}: [market] hold"
        if outside := sorted(str(u) for u in self.pinned if not model.contains(u)):
            raise ConfigError(
                f"{where} names {', '.join(outside[:3])}, which the model "
                f"lacks ({model.n_layer} layers, {model.n_expert} experts per "
                "layer): pin units inside it"
            )
        need = sum(model.size(u) for u in self.pinned)
        if need > self.budget:
            mb = -(-need // (1024 * 1024))
            raise ConfigError(
                f"{where} pins {len(self.pinned)} units that need {need / 2**20:.1f} "
                f"MB, more than memory_budget_mb = {self.config.memory_budget_mb}"
                f": set memory_budget_mb to at least {mb}, or pin fewer units"
            )

    # --- gossip in -------------------------------------------------------------------

    async def _validate_coverage(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        return self._admit(
            msg, lambda value, signer, now: self._apply_coverage(value, signer, now, msg)
        )

    async def _validate_load(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        return self._admit(msg, self._apply_load)

    async def _validate_suspicion(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        return self._admit(msg, self._apply_suspicion)

    def _admit(self, msg: rpc_pb2.Message, apply: Callable[[Any, str, float], None]) -> bool:
        signer = ID(msg.from_id).to_string()
        now = self.clock()
        try:
            if len(msg.data) > MAX_RECORD_BYTES:
                raise WireError(f"record of {len(msg.data)} bytes exceeds {MAX_RECORD_BYTES}")
            apply(unpack(msg.data, MAX_RECORD_BYTES), signer, now)
        except Stale:
            return True  # out of order via another path: not applied, not punished
        except WireError as exc:
            self.gate.rejected[signer] += 1
            log.info("gossip record refused", signer=signer, reason=str(exc)[:200])
            return False
        return True

    def _apply_coverage(
        self, value: Any, signer: str, now: float, msg: rpc_pb2.Message, synced: bool = False
    ) -> None:
        """``synced``: fetched from a peer's map, so stamped at its last keep-alive: it may
        be up to its TTL old, and lives only what is left of that."""
        record = CoverageRecord.from_wire(value)
        if self.proofs is not None and self.proofs.banned(record.peer):
            raise Stale("the peer was caught lying about its holdings")  # ignored, quietly
        if record.peer == self.p2p.peer_id and record.boot != self.boot:
            # our record from before a restart, as a peer's map still holds it (sync, or a
            # late relay): applied, what we held then looked covered by us, and a restarted
            # node (silent while it holds nothing) took other units than the ones on its disk.
            # Peers still count it, so ours goes out now to replace it (publish.py).
            if not self.publisher.supersede:
                log.info(
                    "a peer holds this node's record of its previous run: replacing it",
                    boot=record.boot,
                )
                self.publisher.supersede = True
                self._wake.set()
            raise Stale("a record of this node's previous run")
        if self.map is not None and record.model == self.map.model.model_id:
            self.map.check(record)
        self.gate.check(
            COVERAGE_TOPIC,
            signer,
            record.peer,
            record.seq,
            record.ts,
            now,
            max_age_s=record.ttl if synced else 0.0,
        )
        self.suspicions.settled(record.peer)  # it spoke
        if record.peer == self.p2p.peer_id:
            self.own = msg.SerializeToString()
        if record.model and record.peer != self.p2p.peer_id:
            self.announcers.setdefault(record.model, set()).add(record.peer)
            self.names[record.peer] = (record.model, record.name)
        if record.state == "offline" or not record.model:  # it claims no name any more
            self.names.pop(record.peer, None)
        since = min(now, record.ts) if synced else now
        if self.map is None:  # (validated in full once the model is known)
            self.early[record.peer] = (record, since)
            self.signed[record.peer] = msg.SerializeToString()
        elif self.map.apply(record, since):
            self._mapped(record, msg.SerializeToString())

    def _mapped(self, record: CoverageRecord, raw: bytes) -> None:
        """``record`` changed the map: keep its signed message while the map holds it (what
        sync sends), and note what it claims for the proofs; a node that said goodbye
        leaves both at once."""
        assert self.map is not None
        if record.peer not in self.map.entries:
            self.signed.pop(record.peer, None)
            if self.proofs is not None:
                self.proofs.forget(record.peer)
            return
        self.signed[record.peer] = raw
        if self.proofs is not None and (manifest := self.manifest()) is not None:
            self.proofs.note(record, manifest)

    def _map_early(self) -> None:
        """Map the records that came before the model was known, checked against it now."""
        assert self.map is not None
        early, self.early = self.early, {}
        for peer, (record, since) in early.items():
            raw = self.signed.pop(peer)
            try:
                if record.model == self.map.model.model_id:
                    self.map.check(record)
            except WireError as exc:
                self.gate.rejected[peer] += 1
                log.info("gossip record refused", signer=peer, reason=str(exc)[:200])
                continue
            if self.map.apply(record, since):
                self._mapped(record, raw)

    def _apply_suspicion(self, value: Any, signer: str, now: float) -> None:
        s = Suspicion.from_wire(value)
        self.gate.check(SUSPECT_TOPIC, signer, s.peer, s.seq, s.ts, now)
        self.suspicions.settled(s.suspect)  # someone said it: we need not
        if s.suspect == self.p2p.peer_id:
            log.info("a peer suspects this node: answering with a fresh record", by=s.peer)
            self.publisher.refute = True
            self._wake.set()
        elif s.suspect in self._connected:
            return  # it answers our own liveness pings: first-hand news beats hearsay
        elif self.map is not None and self.map.suspect(
            s.suspect, s.of, now + suspect_s(self.config.heartbeat_s)
        ):
            log.info("holder suspected by a peer that saw it fail", peer=s.suspect, by=s.peer)

    # --- claims checked ----------------------------------------------------------------

    def manifest(self) -> Manifest | None:
        """The manifest of the model we serve, once the store has it."""
        if self.model is None or self.shards is None:
            return None
        try:
            return self.shards.store.manifest(self.model.model_id)
        except Exception:  # noqa: BLE001 - not resolved yet
            return None

    def _latest(self, peer: str) -> CoverageRecord | None:
        entry = self.map.entries.get(peer) if self.map is not None else None
        return entry.record if entry is not None else None

    def _caught_lying(self, peer: str, why: str) -> None:
        if self.map is not None:
            self.map.remove(peer)
        self.signed.pop(peer, None)  # nor relayed to nodes that sync from us
        self.gate.rejected[peer] += 1
        self.gate.forget(peer)
        for announced in self.announcers.values():
            announced.discard(peer)
        self.names.pop(peer, None)
        try:
            self.p2p.gossip.ban(peer)
        except Exception as exc:  # noqa: BLE001 - the gossip service is stopping
            log.debug("could not ban a liar from gossip", peer=peer, error=repr(exc))

    def _apply_load(self, value: Any, signer: str, now: float) -> None:
        report = LoadReport.from_wire(value)
        self.gate.check(LOAD_TOPIC, signer, report.peer, report.seq, report.ts, now)
        if self.demand is not None and report.model == self.demand.model.model_id:
            self.demand.add(report, now)

    # --- gossip out ------------------------------------------------------------------

    def next_seq(self) -> int:
        self._seq = max(self._seq + 1, int(self.clock() * 1000))
        return self._seq

    def record(self) -> CoverageRecord:
        has_all = bool(self.model and self.shards and self.shards.has_all(self.model.model_id))
        name, chosen = (
            self.shards.store.name_claim(self.model.model_id)
            if self.model and self.shards and (self.held or has_all)
            else ("", False)
        )
        return CoverageRecord(
            peer=self.p2p.peer_id,
            seq=self.next_seq(),
            ts=self.clock(),
            ttl=record_ttl(self.config.heartbeat_s, self.participants),
            state=self.state,
            protocol=PROTOCOL_VERSION,
            version=__version__,
            addrs=tuple(self.p2p.addrs()[:16]),
            model=self.model.model_id if self.model and (self.held or has_all) else "",
            budget=self.budget,
            holdings=compress(self.held),
            caps=self.caps,
            has_all=has_all,
            reach=self.p2p.reachability.current.verdict,
            link=self.link,
            boot=self.boot,
            name=name,
            adopted=bool(name) and not chosen,
        )

    async def publish(self) -> None:
        """Publish our record if it changed, a keep-alive or a refutation is due."""
        record, now = self.record(), self.clock()
        if not self.publisher.due(record, now):
            return
        self.publisher.sent(record, now)
        data = pack(record.to_wire())
        try:
            await self.p2p.gossip.publish(COVERAGE_TOPIC, data)
        except Exception as exc:  # noqa: BLE001 - no peers yet, or a peer died mid-send
            log.debug("publishing the coverage record failed", error=repr(exc))

    async def publish_suspicion(self, peer: str, seq: int) -> None:
        s = Suspicion(self.p2p.peer_id, self.next_seq(), self.clock(), peer, seq)
        log.info("holder's connection failed: suspecting it", peer=peer)
        try:
            await self.p2p.gossip.publish(SUSPECT_TOPIC, pack(s.to_wire()))
        except Exception as exc:  # noqa: BLE001 - as publish
            log.debug("publishing a suspicion failed", error=repr(exc))

    async def publish_load(self, report: LoadReport) -> None:
        await self.p2p.gossip.publish(LOAD_TOPIC, pack(report.to_wire()))

    # --- the loops -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        gossip = self.p2p.gossip
        gossip.set_validator(COVERAGE_TOPIC, self._validate_coverage)
        gossip.set_validator(LOAD_TOPIC, self._validate_load)
        gossip.set_validator(SUSPECT_TOPIC, self._validate_suspicion)
        subs = [
            await gossip.subscribe(name) for name in (COVERAGE_TOPIC, LOAD_TOPIC, SUSPECT_TOPIC)
        ]
        self.p2p.host.set_stream_handler(SYNC_PROTOCOL, self._serve_sync)
        self.p2p.host.set_stream_handler(GOODBYE_PROTOCOL, self._serve_goodbye)
        try:
            async with trio.open_nursery() as nursery:
                for sub in subs:
                    nursery.start_soon(_drain, sub)
                if self.proofs is not None:
                    await nursery.start(self.proofs.run, self.manifest)
                nursery.start_soon(self._heartbeat)
                nursery.start_soon(self._sync_when_connected)
                if self.model is None and self.config.model and self.shards is not None:
                    nursery.start_soon(self._resolve_then_enroll)
                elif self.model is not None and (self.budget > 0 or self.pinned):
                    nursery.start_soon(self._enroll_loop)
                else:
                    self.state = "online"
                task_status.started()
                self.taking_part = nursery.cancel_scope
        finally:
            with trio.move_on_after(GOODBYE_TIMEOUT_S) as scope:
                scope.shield = True
                await self._say_goodbye()
            if scope.cancelled_caught:
                log.info(
                    "not every peer heard the goodbye in time: those count this node "
                    "until its record's TTL runs out"
                )
            self.left.set()

    async def _say_goodbye(self) -> None:
        """Publish our record as offline; hand it to each connected peer and wait for the
        answers, and for the gossip copy to be written (for the peers we are not connected
        to, through the ones we are)."""
        self.state = "offline"
        self.held.clear()
        await self.publish()
        if self.own is None:  # never published: no map counts this node
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.p2p.gossip.flush)
            for peer in self.p2p.host.get_connected_peers():
                nursery.start_soon(self._hand_goodbye, peer, self.own)

    async def _hand_goodbye(self, peer: ID, raw: bytes) -> None:
        try:
            stream = await self.p2p.host.new_stream(peer, [GOODBYE_PROTOCOL])
            async with served(stream, "goodbye", peer.to_string()):
                await write_frame(stream, raw)
                await FrameReader(stream, 64).read()  # applied
        except Exception as exc:  # noqa: BLE001 - an old peer, or one going away: gossip then
            log.debug("could not hand the goodbye to a peer", peer=str(peer), error=repr(exc)[:200])

    async def _serve_goodbye(self, stream: INetStream) -> None:
        """A peer that leaves hands us its offline record: checked like gossip, applied,
        then answered."""
        peer = stream.muxed_conn.peer_id.to_string()
        async with served(stream, "goodbye", peer):
            with trio.fail_after(GOODBYE_TIMEOUT_S):
                raw = await FrameReader(stream, MAX_RECORD_BYTES + 4096).read()
                msg = self._coverage_message(raw, "goodbye")
                if ID(msg.from_id).to_string() != peer:
                    raise WireError("goodbye: a record of another peer")
                if self._admit(msg, lambda v, s, now: self._apply_coverage(v, s, now, msg)):
                    await write_frame(stream, True)

    async def leave(self) -> None:
        """Say goodbye while the peers are still connected: end the loops (no round may
        publish this node online again), publish the record as offline and wait until every
        connected peer has applied it. Call it before the p2p host closes; bounded by
        GOODBYE_TIMEOUT_S. A market that has not started yet has told no one anything."""
        if self.taking_part is not None:
            self.taking_part.cancel()
            await self.left.wait()

    async def _heartbeat(self) -> None:
        """Each heartbeat: expire holders whose records stopped, suspect the ones whose
        connections failed, and publish our record when it is due.

        When this process itself was starved (the heartbeat woke up late), records from
        others were not processed either: the lateness is forgiven, so an overloaded
        node does not expire healthy peers and churn the market.
        """
        stall = 0.0
        while True:
            now = self.clock()
            if self.map is not None:
                for peer in self.map.expire(now - stall):
                    log.info(
                        "holder's coverage expired (its TTL ran out, or it was "
                        "suspected and did not answer)",
                        peer=peer,
                    )
                    self.gate.forget(peer)
                    self.signed.pop(peer, None)
                    self.names.pop(peer, None)
                    if self.proofs is not None:
                        self.proofs.forget(peer)
                self._watch_connections(now)
                tellers, silent = census([e.record for e in self.map.entries.values()])
                self.publisher.present = present(self.p2p.peer_id, silent)
                self.participants = participants(tellers, silent)
                self.publisher.keepalive_s = keepalive_s(self.config.heartbeat_s, self.participants)
                self._agree_on_name()
            for peer, seq in self.suspicions.due(now):
                if peer not in self._connected:  # not back meanwhile (a flapping link)
                    await self.publish_suspicion(peer, seq)
            await self.publish()
            began = trio.current_time()
            with trio.move_on_after(self.config.heartbeat_s) as waited:
                await self._wake.wait()
            self._wake = trio.Event()
            if waited.cancelled_caught:
                late = trio.current_time() - began - self.config.heartbeat_s
                stall = max(late, stall * 0.8)

    def _watch_connections(self, now: float) -> None:
        """Peers whose connections liveness dropped since the last heartbeat: the ones that
        hold units are suspected (after ``Suspicions``' delay). A node that had no peers
        and now has some sends its record again: what it published alone reached no one."""
        assert self.map is not None
        connected = {p.peer_id for p in self.p2p.peers.snapshot()}
        for peer in self._connected - connected:
            entry = self.map.entries.get(peer)
            if entry is not None and entry.record.holdings and entry.record.ttl > SUSPECT_TTL_S:
                self.suspicions.observed(peer, entry.record.seq, now, self.rng)
        if connected and not self._connected:
            self.publisher.refute = True
        self._connected = connected

    # --- the map of a starting node ------------------------------------------------------

    async def _serve_sync(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_string()
        async with served(stream, "coverage sync", peer):
            with trio.fail_after(SYNC_TIMEOUT_S):
                batch: list[bytes] = []
                for raw in list(self.signed.values()):
                    batch.append(raw)
                    if sum(map(len, batch)) >= SYNC_FRAME_BYTES:
                        await write_frame(stream, batch)
                        batch = []
                if batch:
                    await write_frame(stream, batch)
                await write_frame(stream, [])

    async def sync(self, peer: ID) -> tuple[int, int]:
        """Fetch ``peer``'s map: each record checked as if it came by gossip (signature,
        schema, sequence, clock), older ones only as old as their TTL. Returns the records
        that passed, and how many of them were news to this node."""
        stream = await self.p2p.host.new_stream(peer, [SYNC_PROTOCOL])
        passed = news = 0
        async with served(stream, "coverage sync", peer.to_string()):
            reader = FrameReader(stream, SYNC_FRAME_BYTES + MAX_RECORD_BYTES + 4096)
            with trio.fail_after(SYNC_TIMEOUT_S):
                while batch := await reader.read():
                    if not isinstance(batch, list):
                        raise WireError("coverage sync: expected a list of messages")
                    for raw in batch:
                        msg = self._coverage_message(raw, "coverage sync")
                        before = len(self.signed)
                        passed += self._admit(
                            msg, functools.partial(self._apply_coverage, msg=msg, synced=True)
                        )
                        news += len(self.signed) > before
        return passed, news

    def _coverage_message(self, raw: Any, what: str) -> rpc_pb2.Message:
        """A coverage record as its signer's gossip message, passed on by a peer (sync, a
        goodbye): signed by its signer, of our network's coverage topic."""
        if not isinstance(raw, bytes):  # bytes(an int) would allocate it
            raise WireError(f"{what}: expected messages as bytes")
        try:
            msg = rpc_pb2.Message.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError
            raise WireError(f"{what}: not a gossip message ({exc})") from None
        if list(msg.topicIDs) != [self.p2p.gossip.topic(COVERAGE_TOPIC)] or not signature_validator(
            msg
        ):
            raise WireError(f"{what}: a message not signed by its sender, or of another topic")
        return msg

    async def _sync_when_connected(self) -> None:
        """Fetch the map once a peer is connected (a node started alone fetches nothing)."""
        while not self.p2p.host.get_connected_peers():  # noqa: ASYNC110 - no event for a first peer
            await trio.sleep(min(self.config.heartbeat_s, 1.0))
        await self._sync_from_peers()

    async def _sync_from_peers(self) -> None:
        peers = list(self.p2p.host.get_connected_peers())
        for i in self.rng.permutation(len(peers))[:SYNC_PEERS]:
            try:
                passed, news = await self.sync(peers[int(i)])
                log.info(
                    "fetched the coverage map from a peer",
                    peer=str(peers[int(i)]),
                    records=passed,
                    new=news,
                )
            except Exception as exc:  # noqa: BLE001 - an old peer, or one going away
                log.debug(
                    "could not fetch the coverage map from a peer",
                    peer=str(peers[int(i)]),
                    error=repr(exc)[:200],
                )

    async def _resolve_then_enroll(self) -> None:
        assert self.shards is not None
        manifest = await self.shards.resolve(
            self.config.model, lambda m: sorted(self.announcers.get(m, ())), self.named
        )
        self._use(MarketModel.from_manifest(manifest))
        self._map_early()
        if self.budget > 0 or self.pinned:
            await self._enroll_loop()
        else:
            self.state = "online"

    def named(self, text: str) -> list[str]:
        """The ids of the models that ``text`` names (``names.named_by``) by what peers
        announce: more than one when two models claim one name."""
        return sorted({model for model, name in self.names.values() if named_by(text, model, name)})

    def _agree_on_name(self) -> None:
        """Call our model what the network calls it (``names.agreed_name`` of our own claim
        and the records in our map); a model we got from peers is listed so in the store
        too, so the next start (and `kvasird model list`) calls it the same."""
        if self.model is None or self.map is None:
            return
        if self.shards is None:  # no store: a node of a test, or one that holds no bytes
            self.name = self.model.model_id[:12]
            return
        store, model_id = self.shards.store, self.model.model_id
        own = store.name_claim(model_id)
        agreed = agreed_name(
            [
                own,
                *(
                    (e.record.name, not e.record.adopted)
                    for e in self.map.entries.values()
                    if e.record.model == model_id and e.record.peer != self.p2p.peer_id
                ),
            ]
        )
        if agreed and not own[1] and agreed != own[0]:
            log.info("the network names the model", model=model_id[:16], name=agreed)
            store.adopt_name(model_id, agreed)
        self.name = agreed or store.name_of(model_id) or model_id[:12]

    def sources(self, units: tuple[Unit, ...]) -> list[str]:
        """Peers to download ``units`` from: full copies first, then online holders."""
        assert self.map is not None
        full = [p for p, e in self.map.entries.items() if e.record.has_all]
        partial = {p for u in units for p in self.map.holders(u, frozenset({"online"}))}
        return [p for p in full + sorted(partial - set(full)) if p != self.p2p.peer_id]

    async def _enroll_loop(self) -> None:
        # Listen first, fetch the map again (the first fetch may have been from a peer as
        # new as we are), then a random delay.
        await trio.sleep(self.config.heartbeat_s * LISTEN_HEARTBEATS)
        await self._sync_from_peers()
        await trio.sleep(float(self.rng.uniform(0, self.config.enroll_delay_s)))
        while True:
            await self.rebalance()
            await trio.sleep(self.config.rebalance_s * float(self.rng.uniform(0.7, 1.3)))

    async def rebalance(self) -> None:
        """One round: decide, announce, obtain and load; then the engine serves exactly what
        ``held`` says (rebuilt when an add failed after its drop), and a downloaded model's
        store is pruned back to the budget."""
        assert self.map is not None and self.model is not None and self.demand is not None
        self.map.expire(self.clock())
        records = [e.record for e in self.map.entries.values()]
        peers = self.participants = participants(*census(records))
        targets = with_spare(
            self.demand.targets(self.config.target_replicas),
            self.model,
            market_budget(records, peers),
        )
        held_bytes = sum(self.model.size(u) for u in self.held)
        rate = self.bandwidth.rate
        if not self.pinned - set(self.held) and not joins_round(
            self.model,
            self.map.active,
            targets,
            peers,
            self.budget,
            rate,
            self.config.rebalance_s,
            self.config.heartbeat_s,
            self.rng,
        ):
            self.state = "online"  # nothing for us this round (the herd guard)
            await self.publish()
            return
        budget = round_budget(self.model, self.budget, held_bytes, rate)
        plan = decide(
            self.model,
            self.map.active,
            targets,
            self.p2p.peer_id,
            budget,
            set(self.held),
            self.pinned,
            self.map.holders,
            self.rng,
            peers=peers,
            stored=await self._stored(),
        )
        if plan.drop:
            for u in plan.drop:
                self.held[u] = "draining"
            await self.publish()
            for u in plan.drop:
                del self.held[u]
        added = not plan.add or await self._add(plan.add, len(plan.drop))
        if not added:  # (units are dropped only to make room for an add)
            await self._sync_engine()
        if added:
            self.state = "online"
            if plan.add or plan.drop:
                await self.publish()
        if plan.add or plan.drop:
            await self._prune()

    async def _stored(self) -> set[Unit]:
        """Units whose bytes are in our store already (a restart's previous holdings)."""
        if self.shards is None or self.model is None or self.held:
            return set()  # only the first round after a start needs it
        return set(await trio.to_thread.run_sync(self.shards.store.held_units, self.model.model_id))

    async def _sync_engine(self) -> None:
        """Rebuild the engine for what we hold now (a drop, or an add that failed after it,
        left it serving units no longer in our record and in our budget)."""
        try:
            await self.loader([])
        except Exception as exc:  # noqa: BLE001 - the old engine serves on, a superset
            log.warning(
                "could not rebuild the engine for the units still held; it serves "
                "what it held before",
                error=str(exc)[:300],
            )

    async def _prune(self) -> None:
        if self.shards is not None and self.model is not None:
            await trio.to_thread.run_sync(
                self.shards.prune, self.model.model_id, set(self.held), self.budget
            )

    async def _add(self, add: tuple[Unit, ...], dropping: int) -> bool:
        """Announce, obtain and load ``add``; False (the units given up) when that failed."""
        assert self.model is not None
        log.info(
            "enrolling",
            units=len(add),
            dropping=dropping,
            bytes=sum(self.model.size(u) for u in add),
        )
        for u in add:
            self.held[u] = "joining"
        await self.publish()
        for u in add:  # not published: to peers, loading is joining (active, not routable)
            self.held[u] = "loading"
        try:
            if self.shards is not None:
                report = await self.shards.fetch(self.model.model_id, add, self.sources(add))
                if report is not None:
                    self.bandwidth.observe(report.received_bytes, report.seconds)
                if report is not None and self.proofs is not None:
                    for peer in report.bad_holders:
                        self.proofs.condemn(peer, "sent bytes that are not the model's")
            await self.loader(list(add))
        except Exception as exc:  # noqa: BLE001 - a failed download or load gives the units up
            log.warning(
                "could not obtain or load enrolled units; giving them up",
                units=len(add),
                error=str(exc)[:300],
            )
            for u in add:
                del self.held[u]
            await self.publish()
            return False
        for u in add:
            self.held[u] = "online"
        return True

    # --- views -----------------------------------------------------------------------

    def coverage(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "peer_id": self.p2p.peer_id,
            "state": self.state,
            "held": [str(u) for u in sorted(self.held)],
            "held_bytes": sum(self.model.size(u) for u in self.held) if self.model else 0,
            "budget_bytes": self.budget,
            "rejected": dict(self.gate.rejected),
            "gossip_scores": self._scores(),
        }
        if self.map is None or self.model is None or self.demand is None:
            return {**out, "model": None, "fully_covered": False, "routable": False}
        targets = self.demand.targets(self.config.target_replicas)
        out.update(
            {
                "model": {
                    "id": self.model.model_id,
                    "name": self.name,
                    "n_layer": self.model.n_layer,
                    "n_expert": self.model.n_expert,
                    "bytes": self.model.total_bytes,
                },
                "holders": {
                    p: {
                        "state": e.record.state,
                        "budget": e.record.budget,
                        "boot": e.record.boot,
                        "holdings": [h.to_wire() for h in e.record.holdings],
                        "proven_units": None
                        if self.proofs is None
                        else len(self.proofs.proven(e.record)),
                    }
                    for p, e in self.map.entries.items()
                },
                "proofs": None if self.proofs is None else self.proofs.view(),
                "segments": segments(self.model, self.map.active, targets),
                "fully_covered": fully_covered(self.map.active, targets),
                "routable": fully_covered(self.map.online, self.demand.targets(1)),
            }
        )
        return out

    def _scores(self) -> dict[str, float]:
        router = self.p2p.gossip.router
        scorer = router.scorer
        if scorer is None:  # py-libp2p's gossipsub always makes one; its type allows none
            return {}
        topics = [self.p2p.gossip.topic(COVERAGE_TOPIC), self.p2p.gossip.topic(LOAD_TOPIC)]
        return {
            pid.to_string(): round(scorer.score(pid, topics), 3)
            for pid in list(router.peer_protocol)
        }


async def _drain(sub: Any) -> None:
    """Records are applied in the validator; empty the subscription so it never backs up."""
    while True:
        await sub.get()
