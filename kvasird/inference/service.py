"""InferenceService: this node's part in the data plane, wired into the daemon.

market loader ──units──▶ Served (stages + expert workers, built in a thread)
"/kvasir/stage/1"   ──▶ StageServer   (sessions on our stages)
"/kvasir/experts/1" ──▶ ExpertServer  (batched expert rows for other stages)
LaneServer (TCP) ──▶ the same two handlers over lanes (direct, sealed; lane.py)
SwarmGenerator ── routes over the coverage map ──▶ peers' StageServers (or ours, in process)
               ◀── Inbox ◀── the head's token (boundaries go stage to stage, one-way)
status(): routes, sessions, unfit (the admin API's GET /v0/inference, kvasird.admin.generate)
every few heartbeats: a LoadReport (tokens computed, experts selected) on gossip
spot-check failures: an unfit verdict on gossip (Verdicts; a quorum of accusers counts)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import trio
from libp2p.custom_types import TProtocol

from kvasird import PROTOCOL_VERSION
from kvasird.compute.experts import ExpertWorker
from kvasird.compute.graph import Backend
from kvasird.compute.hparams import DEFAULT_CONTEXT
from kvasird.compute.runtime import compute_threads
from kvasird.compute.sampling import LLAMA_SERVER, Recommended
from kvasird.compute.weights import EXPERT_SUFFIXES, load_weights
from kvasird.config import Config
from kvasird.errors import KvasirError
from kvasird.inference.api import ModelInfo
from kvasird.inference.client.choice import ExpertChoice
from kvasird.inference.client.dispatch import ExpertDispatcher
from kvasird.inference.client.hotcache import HotExperts
from kvasird.inference.client.routing import Fitness, Latency, PeerHoldings
from kvasird.inference.client.speculate import MAX_K, DraftModel
from kvasird.inference.client.spotcheck import SpotChecks
from kvasird.inference.client.swarm import FAST_START_RTT_MS, Inbox, SwarmGenerator
from kvasird.inference.errors import Refusal
from kvasird.inference.protocol import EXPERT_PROTOCOL, STAGE_PROTOCOL, experts, stage
from kvasird.inference.protocol.delegation import Issuer, Verifier
from kvasird.inference.server.engine import Holdings, Served
from kvasird.inference.server.experts import ExpertServer
from kvasird.inference.server.stage import StageServer
from kvasird.inference.transport.channel import Channels, serve
from kvasird.inference.transport.lane import LaneServer, tcp_ip
from kvasird.inference.verdicts import Verdicts
from kvasird.logs import get_logger
from kvasird.market.records import CoverageRecord, LoadReport
from kvasird.market.service import MarketService
from kvasird.model.manifest import Unit
from kvasird.p2p import P2PNode
from kvasird.settlement.admission import Admission, NotAdmitted
from kvasird.settlement.rewards import MeasuredWork
from kvasird.settlement.wallet import WalletLink
from kvasird.text.tokenizer import Tokenizer
from kvasird.wire.rpc import MAX_FRAME, Handler, Intake

ADMITTED_S = 1.0
"""A step or an expert request leans on its gateway's last pass of the stake and debt checks
this long (a session's stages checked them at open anyway); the meter counts every one."""
RETIRE_GRACE_S = 2.0
"""A replaced engine is freed this long after its last session ended."""
REPORT_HEARTBEATS = 3
DRAFT_WAIT_S = 0.5
"""How often the draft model's loader looks for the served model's manifest."""
log = get_logger("kvasird.inference")


class OwnUse(Protocol):
    """The operator's own use, paid like the gateway's (kvasird.gateway.payment.OwnUse)."""

    async def charge(self, prompt: int, output: int) -> Any: ...

    def settle(self, charge: Any, work: list[MeasuredWork], prompt: int, tokens: int) -> None: ...


class InferenceService:
    def __init__(self, p2p: P2PNode, market: MarketService, config: Config) -> None:
        self.p2p, self.market, self.config = p2p, market, config
        c = config.inference
        self.served: Served | None = None
        self.holdings = Holdings()
        self._holdings_of: dict[str, tuple[CoverageRecord, int, PeerHoldings]] = {}
        """Each peer's proven holdings as last read from its record (kept while the record
        is the same object and no proof changed: holders() runs for every remote MoE
        layer of every token)."""
        self.channels = Channels(p2p.host, lanes=c.lanes, connect=p2p.connect, twin=self._far)
        self.lanes = (
            LaneServer(_lane_host(config.p2p.listen), c.lane_port, MAX_FRAME, p2p.config_path)
            if c.lanes
            else None
        )
        self.fitness = Fitness(c.unfit_s)
        self.latency = Latency(p2p.peer_id, self._rtt)
        self.verdicts = Verdicts(p2p.gossip, p2p.peer_id, self.fitness, c.unfit_quorum, c.unfit_s)
        self.inbox = Inbox()
        self.spot = SpotChecks(
            c.spot_check_stages,
            c.spot_check,
            c.spot_tolerance,
            Path(p2p.config_path).parent / "spotchecks",
        )
        """Spot checks of the peers this node's generations and stages use (the evidence of
        those caught is kept in <home>/spotchecks)."""
        self.stages = StageServer(
            self._model_id,
            lambda: self.served,
            max_sessions=c.max_sessions,
            idle_s=c.session_idle_s,
            wire_dtype=c.wire_dtype,
            me=p2p.peer_id,
            send=self._send_stage,
            deliver=self.inbox.deliver,
            prefix=c.prefix_cache,
            batch_rows=c.batch_sessions,
            batch_window_s=c.batch_window_ms / 1000,
            batch_min_s=c.batch_min_ms / 1000,
            batch_pipelined=c.batch_pipelined,
            delegations=Verifier(p2p.network),
        )
        self.issuer = Issuer(p2p.key.keypair, p2p.network)
        """Signs this node's delegations: to each hop it opens a session on, and its own."""
        self.experts = ExpertServer(
            lambda: self.served,
            window_s=c.batch_window_ms / 1000,
            wire_dtype=c.wire_dtype,
            delegations=Verifier(p2p.network),
        )
        self.choice = ExpertChoice(
            p2p.peer_id, self.holders, self.latency, self.fitness, c.expert_choice
        )
        """Per MoE layer and step: a fallback replica's own copy or the workers."""
        self.dispatcher = ExpertDispatcher(
            self.issuer,
            self.holders,
            self.channels,
            self.latency,
            self.fitness,
            self._own_experts,
            timeout_s=c.expert_timeout_s,
            wire_dtype=c.wire_dtype,
            spot_check=c.spot_check,
            tolerance=c.spot_tolerance,
            hot=HotExperts(self._load_hot, c.hot_experts, c.hot_after),
            accuse=self.verdicts.accuse,
            window_s=c.batch_window_ms / 1000,
            spot=self.spot,
            choice=self.choice,
        )
        self.generator = SwarmGenerator(
            p2p.peer_id,
            self._info,
            self._n_layer,
            self.holders,
            self.channels,
            self.stages.handle,
            self.latency,
            self.fitness,
            c,
            self.inbox,
            issuer=self.issuer,
            spot=self.spot,
            accuse=self.verdicts.accuse,
            speculable=self._speculable,
        )
        self._extra: list[tuple[str, Handler]] = []
        self.own_use: OwnUse | None = None
        """On a paid node: charges the admin API's generations to the operator's wallet and
        receipts them to the peers (set by the daemon with settlement)."""
        self._nursery: trio.Nursery | None = None
        self._load_lock = trio.Lock()
        self._hot_backend: Backend | None = None

    # --- what we know of the model and the swarm ----------------------------------------

    def _model_id(self) -> str:
        return self.market.model.model_id if self.market.model else ""

    def _n_layer(self) -> int:
        return self.market.model.n_layer if self.market.model else 0

    def units_per_token(self) -> int:
        """Work units a token costs through the whole model, as receipts count them: a
        position per layer and the head, and each MoE layer's selected experts."""
        hp = self.served.hp if self.served is not None else None
        experts = hp.n_layer * hp.n_expert_used if hp is not None and hp.is_moe else 0
        return self._n_layer() + 1 + experts

    def _info(self) -> ModelInfo | None:
        """The model we route, by the name the network gives it; its context is what it was
        trained on (from our loaded engine when we hold a part, else from its manifest),
        within our KV slots."""
        if self.market.model is None:
            return None
        served, kv = self.served, self.config.inference.kv_slots
        manifest = self.market.manifest()
        if served is not None:
            trained = served.hp.n_ctx_train
        else:
            trained = (
                kv
                if manifest is None
                else int(manifest.meta(f"{manifest.arch}.context_length", DEFAULT_CONTEXT))
            )
        recommended = LLAMA_SERVER if manifest is None else Recommended.of(manifest.meta)
        return ModelInfo(self._model_id(), self.market.name, min(trained, kv), recommended)

    def _sources(self, units: list[Unit]) -> list[Path]:
        """The GGUF files holding `units`: the original, or verified slices from the store."""
        if self.market.shards is not None and self.market.model is not None:
            return self.market.shards.model_files(self.market.model.model_id, units)
        return [Path(self.config.market.model).expanduser()]

    def _own_experts(self, layer: int, expert: int) -> tuple[ExpertWorker, int, int] | None:
        """The worker of our held range of ``layer``'s experts that holds ``expert``."""
        run = None if self.served is None else self.served.run_of(layer, expert)
        return None if run is None else (run.worker, run.first, run.end)

    async def _load_hot(self, layer: int, expert: int) -> ExpertWorker:
        """One expert into a worker of the hot-expert cache: its bytes fetched from the
        peers that hold it when our store lacks them (a stage usually holds only its
        windows), then read off the loop."""
        unit = Unit("expert", layer, expert)
        market = self.market
        fetched = (
            market.shards is not None
            and market.model is not None
            and market.map is not None
            and await market.shards.fetch(market.model.model_id, [unit], market.sources((unit,)))
        )
        if fetched:
            self.dispatcher.stats["hot_fetched"] += 1
        return await trio.to_thread.run_sync(self._load_hot_now, layer, expert)

    def _load_hot_now(self, layer: int, expert: int) -> ExpertWorker:
        if self._hot_backend is None:
            self._hot_backend = Backend(compute_threads(self.config.compute.threads))
        names = [f"blk.{layer}.{s}" for s in EXPERT_SUFFIXES]
        sources = self._sources([Unit("expert", layer, expert)])
        weights = load_weights(sources, self._hot_backend, names, {layer: (expert, expert + 1)})
        return ExpertWorker(weights, self._hot_backend)

    async def _send_stage(self, peer: str, msg: dict[str, Any]) -> None:
        """A forwarded step or a result, to a peer or (in process) to ourselves."""
        if peer == self.p2p.peer_id:
            await self.stages.handle(peer, msg)
        else:
            await self.channels.notify(
                peer, STAGE_PROTOCOL, msg, self.config.inference.step_timeout_s
            )

    def _far(self, peer: str) -> bool:
        """Whether `peer` is far enough for small stage messages to go on two paths."""
        rtt = self._rtt(peer)
        return rtt is not None and rtt >= FAST_START_RTT_MS

    def _rtt(self, peer: str) -> float | None:
        info = self.p2p.peers.get(peer)
        return info.rtt_ms if info is not None else None

    def holders(self) -> list[PeerHoldings]:
        """Every peer serving this model now, ourselves included (from what we loaded).

        Peers speaking another wire protocol version are never routed to.
        """
        out: list[PeerHoldings] = []
        proofs = self.market.proofs
        version = proofs.version if proofs is not None else 0
        if self.market.map is not None:
            entries, known = self.market.map.entries, self._holdings_of
            if len(known) > 2 * len(entries) + 16:  # forget peers gone from the map
                self._holdings_of = known = {p: v for p, v in known.items() if p in entries}
            for p, e in entries.items():
                r = e.record
                if p == self.p2p.peer_id or r.state == "offline" or r.protocol != PROTOCOL_VERSION:
                    continue
                hit = known.get(p)
                if hit is None or hit[0] is not r or hit[1] != version:
                    if hit is not None and r.boot != hit[0].boot and self.fitness.restarted(p):
                        log.info("peer restarted: its failures are forgiven", peer=p)
                    held = PeerHoldings.of_record(
                        r, proofs.proven(r) if proofs is not None else None
                    )
                    hit = known[p] = (r, version, held)
                out.append(hit[2])
        if self.served is not None:
            h = self.holdings
            out.append(PeerHoldings(self.p2p.peer_id, h.head, h.windows, h.experts))
        return out

    def link_of(self, peer: str) -> WalletLink | None:
        """The payout wallet a peer links in its coverage record (verified when parsed)."""
        entry = self.market.map.entries.get(peer) if self.market.map is not None else None
        return entry.record.link if entry is not None else None

    def use_admission(self, admission: Admission) -> None:
        """A paid network: sessions open here, steps compute and expert rows are computed
        only for the gateways ``admission`` accepts, each piece of work metered before it
        is done; the reason of a refusal goes back as an "unpaid" refusal."""

        async def admit(gateway: str, units: int) -> None:
            try:  # a session's open checks in full; its steps and rows lean on a recent pass
                await admission.check(gateway, ADMITTED_S if units else 0.0)
                admission.charge(gateway, units)
            except NotAdmitted as exc:
                raise Refusal("unpaid", str(exc)) from None

        self.stages.admit = self.experts.admit = admit

    def also_serve(self, protocol: str, handle: Handler) -> None:
        """Another request protocol on the same streams and lanes (call before ``run``)."""
        self._extra.append((protocol, handle))

    # --- loading what the market enrolled us into ---------------------------------------

    async def load(self, units: list[Unit]) -> None:
        """The market's loader: (re)build the engine for everything we hold now."""
        if self.market.model is None:
            return
        async with self._load_lock:
            held = [u for u, s in self.market.held.items() if s != "draining"]
            wanted = Holdings.of(held)
            if wanted == self.holdings:
                return
            c = self.config
            began = time.monotonic()
            served = (
                None
                if not held
                else await trio.to_thread.run_sync(
                    lambda: Served.build(
                        self._sources(held),
                        wanted,
                        threads=c.compute.threads,
                        kv_slots=c.inference.kv_slots,
                        kv_dtype=c.inference.kv_dtype,
                        state_slots=c.inference.state_slots,
                        window_sessions=c.inference.window_sessions,
                        remote=self.dispatcher.shard,
                        choose=self.choice,
                    )
                )
            )
            old, self.served, self.holdings = self.served, served, wanted
            if old is not None and self._nursery is not None:
                self._nursery.start_soon(self._retire, old)
            log.info(
                "serving",
                head=wanted.head,
                windows=list(wanted.windows),
                experts=len(wanted.experts),
                seconds=round(time.monotonic() - began, 2),
            )

    async def _retire(self, old: Served) -> None:
        """Free a replaced engine once no session runs on it (they finish or expire)."""
        await self.stages.wait_unused(old.all_stages())
        await trio.sleep(RETIRE_GRACE_S)  # a step that was already running finishes
        old.close()

    # --- running -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        idle = self.config.inference.session_idle_s
        host = self.p2p.host
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.generator.nursery = nursery
                self.dispatcher.hot.nursery = nursery
                await nursery.start(self.channels.run)
                await nursery.start(self.verdicts.run)
                protocols: list[
                    tuple[
                        str,
                        Callable[[dict[str, Any]], Any] | None,
                        Handler,
                        Callable[[Any], bool] | None,
                        Intake | None,
                    ]
                ] = [
                    (
                        STAGE_PROTOCOL,
                        stage.parse,
                        self.stages.answer,
                        self.stages.inline,
                        Intake(self.stages.admitted),
                    ),
                    (
                        EXPERT_PROTOCOL,
                        experts.parse,
                        self.experts.answer,
                        None,
                        Intake(self.experts.admitted),
                    ),
                    *((p, None, h, None, None) for p, h in self._extra),
                ]
                for protocol, parse, handle, inline, intake in protocols:
                    answer = functools.partial(
                        serve, handle=handle, idle_s=idle, parse=parse, inline=inline, intake=intake
                    )
                    host.set_stream_handler(
                        TProtocol(protocol),
                        functools.partial(answer, lanes=self.lanes, protocol=protocol),
                    )
                    if self.lanes is not None:
                        self.lanes.register(protocol, answer)
                if self.lanes is not None:
                    await nursery.start(self.lanes.run)
                nursery.start_soon(self._housekeeping)
                c = self.config.inference
                if c.draft_model and c.speculate in ("draft", "auto"):
                    nursery.start_soon(self._load_draft, c.draft_model)
                task_status.started()
        finally:
            self.stages.close_all()
            self.dispatcher.hot.close()
            if self._hot_backend is not None:
                self._hot_backend.close()
            if self.generator.draft is not None:
                self.generator.draft.close()
            if self.served is not None:
                self.served.close()
                self.served = None

    def _speculable(self) -> str:
        """Why generations of the model cannot be speculated on ("" when they can)."""
        manifest = self.market.manifest()
        if manifest is None:
            return "the model's manifest is not here yet"
        return ""

    async def _load_draft(self, path: str) -> None:
        """Load [inference] draft_model once the served model's manifest is here (its
        vocabulary is checked against the manifest's; the manifest arrives through the
        market, which has no event to wait on); without it, "auto" speculates by prompt
        lookup and "draft" not at all."""
        while True:
            if (manifest := self.market.manifest()) is not None:
                break
            await trio.sleep(DRAFT_WAIT_S)
        try:
            tokens = Tokenizer.from_metadata(manifest.metadata, path).tokens
            self.generator.draft = await trio.to_thread.run_sync(
                functools.partial(DraftModel, path, tokens, self.config.compute.threads)
            )
        except KvasirError as exc:
            log.error(
                "the draft model cannot draft for the served model: speculating without it",
                path=path,
                error=str(exc),
            )
            return
        log.info("draft model loaded for speculative decoding", path=path)

    async def _housekeeping(self) -> None:
        period = self.config.market.heartbeat_s * REPORT_HEARTBEATS
        last = time.time()
        while True:
            await trio.sleep(period)
            self.stages.expire()
            now = time.time()
            await self._report(now - last)
            last = now

    async def _report(self, window_s: float) -> None:
        tokens, selected = self.stages.tokens, self.dispatcher.selected
        self.stages.tokens = 0
        self.dispatcher.selected = type(selected)()
        if not self.market.model or (tokens == 0 and not selected):
            return
        report = LoadReport(
            self.p2p.peer_id,
            self.market.next_seq(),
            time.time(),
            self._model_id(),
            max(window_s, 0.1),
            tokens,
            tuple((layer, e, n) for (layer, e), n in sorted(selected.items())),
        )
        try:
            await self.market.publish_load(report)
        except Exception as exc:  # noqa: BLE001 - no peers to publish to
            log.debug("load report not published", error=repr(exc))

    # --- what the admin API shows (kvasird.admin.generate serves it) ---------------------

    def status(self) -> dict[str, Any]:
        return {
            "serving": {
                "head": self.holdings.head,
                "windows": list(self.holdings.windows),
                "experts": list(self.holdings.experts),
                "sessions": len(self.stages.sessions),
                "forwarded": self.stages.forwarded,
                "replayed": self.stages.replayed,
                "rows_apart": self.stages.rows_apart,
                "expert_rows": self.experts.rows,
                "expert_calls": self.experts.calls,
                "batches": dict(self.stages.batcher.stats),
            },
            "generations": {
                rid: {
                    "route": list(p.route),
                    "tokens": p.tokens,
                    "failovers": p.failovers,
                    "hop_ms": p.hop_ms,
                    "step_ms": p.step_ms,
                    "guessed": p.guessed,
                    "accepted": p.accepted,
                }
                for rid, p in self.generator.active.items()
            },
            "breakdown": self.generator.traces.summary(),
            "first_chunk": self.generator.first_traces.summary(),
            "speculation": self._speculation_status(),
            "prefix": self._prefix_status(),
            "dispatch": dict(self.dispatcher.stats),
            "expert_choice": {
                "mode": self.choice.mode,
                "layers": {str(k): dict(v) for k, v in sorted(self.choice.counts.items())},
                "estimates": {
                    str(k): {
                        "ours_ms": round(ours, 3),
                        "theirs_ms": None if theirs is None else round(theirs, 3),
                    }
                    for k, (ours, theirs) in sorted(self.choice.last.items())
                },
            },
            "unfit": self.fitness.snapshot(),
            "spot_checks": self.spot.status(),
            "lanes": {
                "port": self.lanes.port if self.lanes else None,
                "accepted": self.lanes.lanes if self.lanes else 0,
                "refused": self.lanes.refused if self.lanes else 0,
                "open_to": sorted({p for p, _ in self.channels.lanes_up()}),
                "libp2p_to": sorted({p for p, _ in self.channels.on_libp2p()}),
            },
        }

    def _speculation_status(self) -> dict[str, Any]:
        """Speculative decoding as a gateway: the mode, why it is off if it is, what it
        guessed and the head accepted since start, and what it measured per source."""
        gen, c = self.generator, self.config.inference
        return {
            "mode": c.speculate,
            "draft_model": str(gen.draft.path) if gen.draft is not None else None,
            "off_because": gen.speculable(),
            **{k: gen.speculation[k] for k in ("steps", "guessed", "accepted", "ahead")},
            "sources": {
                name: {
                    "accept_rate": round(e.accept_rate(), 3),
                    "step_ms": round(e.t1 * 1000, 2) if e.t1 is not None else None,
                    "row_ms": round(e.t_row * 1000, 2) if e.t_row is not None else None,
                    "guess_ms": round(e.t_guess * 1000, 2),
                    "k": e.best_k(MAX_K),
                }
                for name, e in gen.estimates.items()
            },
        }

    def _prefix_status(self) -> dict[str, int]:
        """Prefix reuse: prompt tokens this node's generations started from kept KV, and its
        layer windows' kept pages (KV of finished sessions) and the pages sessions reused."""
        pools = [st.kv for st in self.served.windows.values()] if self.served else []
        caches = [kv.prefix for kv in pools if kv.prefix is not None]
        return {
            "reused_tokens": self.generator.reused,
            "kept_pages": sum(len(c) for c in caches),
            "reused_pages": sum(c.hits for c in caches),
        }


def _lane_host(listen: tuple[str, ...]) -> str:
    """The IP lanes listen on: that of the first TCP listen address (all interfaces if none)."""
    return next((ip for addr in listen if (ip := tcp_ip(addr))), "0.0.0.0")
