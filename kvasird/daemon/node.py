"""Node: a running kvasird, and the signal handling around it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from kvasird import PROTOCOL_VERSION, __version__
from kvasird.admin import generate
from kvasird.admin.server import build_app
from kvasird.compute import arch as archs
from kvasird.compute.graph import use_device
from kvasird.config import Config
from kvasird.daemon import earnings, systemd, wiring
from kvasird.daemon.banner import print_banner, print_ready, print_waiting
from kvasird.daemon.risks import risky_settings
from kvasird.db import connect
from kvasird.gateway.payment import OwnUse
from kvasird.home import Home
from kvasird.http import serve_asgi
from kvasird.identity import load_node_key
from kvasird.inference.service import InferenceService
from kvasird.logs import get_logger
from kvasird.market.records import Capabilities
from kvasird.market.service import GOODBYE_TIMEOUT_S, MarketService, metadata_only
from kvasird.model.distribution import ShardService
from kvasird.model.gguffile import read_header
from kvasird.model.ref import ModelRef
from kvasird.model.store import ShardStore
from kvasird.p2p import P2PNode
from kvasird.ports import check_ports
from kvasird.settlement.admission import Admission, Rates
from kvasird.settlement.config import SettlementConfig
from kvasird.settlement.exchange import SETTLE_PROTOCOL, Exchange
from kvasird.settlement.gossip import GovernanceGossip
from kvasird.settlement.service import Settlement, run_settlement, with_network_keys

log = get_logger("kvasird.daemon")

NO_PEERS_DIAGNOSIS_S = 60.0
READY_POLL_S = 0.1
"""How often a starting node looks whether it serves yet: "ready" follows health at once."""
START_EXTEND_S = 30.0
"""How long systemd waits, past TimeoutStartSec, for the next STATUS= while not ready."""
DRAIN_TIMEOUT_S = 8.0


class Node:
    def __init__(self, home: Home, config: Config) -> None:
        use_device(config.compute.device)  # before anything opens a ggml backend
        self.home = home
        self.config = config
        self.db = connect(home.db)
        self.key = load_node_key(home.node_key)
        self.p2p = P2PNode(self.key, config.p2p, config.node.network, self.db, str(home.config))
        self.shards = ShardService(self.p2p, ShardStore.open(home))
        self.market = MarketService(
            self.p2p,
            config.market,
            None,
            Capabilities(
                backend=config.compute.device or "CPU", threads=config.compute.threads or 1
            ),
            shards=self.shards,
            loader=(lambda units: self.inference.load(units))
            if config.inference.serve
            else metadata_only,
        )
        self.inference = InferenceService(self.p2p, self.market, config)
        self.gateway = wiring.gateway_of(self)
        self.settlement: Settlement | None = None
        """Payments and rewards, once started (None while [settlement] is off)."""
        self.admission: Admission | None = None
        """Whom this node works for (None while [settlement] is off: everyone)."""
        self.exchange: Exchange | None = None
        """Receipts and claims with other peers (None while [settlement] is off)."""
        self.governance = GovernanceGossip(
            self.p2p.gossip,
            lambda: self.settlement,
            config.node.network,
            config.settlement.genesis_wallet,
            str(home.config),
        )
        self.started_at = time.monotonic()

    def status(self) -> dict[str, Any]:
        addrs = self.p2p.addrs()
        return {
            "peer_id": self.p2p.peer_id,
            "network": self.config.node.network,
            "listen_addrs": addrs,
            "join_addr": _preferred_join(addrs),
            "peers": len(self.p2p.peers),
            "reachability": self.p2p.reach_status(),
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "gateway": self.gateway.url,
            "earnings": earnings.totals(self),
        }

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every service; report the admin URL once all listen. Cancel to drain."""
        try:
            check_ports(self.config, str(self.home.config))  # one line for a taken port
            risks = risky_settings(self.config, str(self.home.config))
            for risk in risks:
                log.warning(risk)
            self._check_model_file()
            settling = (
                await with_network_keys(
                    SettlementConfig(self.config.settlement), str(self.home.config)
                )
                if self.config.settlement.enabled
                else None
            )  # before joining
            async with self.p2p.running(), trio.open_nursery() as nursery:
                await nursery.start(self.shards.run)
                if settling is not None:
                    self.settlement = await nursery.start(
                        run_settlement,
                        settling,
                        self.home,
                        self.p2p.peer_id,
                        self.config.node.network,
                    )
                    await nursery.start(self._exchange_receipts, self.settlement)
                await nursery.start(self.governance.run)
                await nursery.start(self.inference.run)
                await nursery.start(self.market.run)
                app = build_app(wiring.admin_of(self))
                app.router.routes.extend([*generate.routes(self.inference), *earnings.routes(self)])
                admin_url = await nursery.start(
                    lambda task_status: serve_asgi(
                        app,
                        self.config.admin.listen,
                        what="admin API",
                        section="admin",
                        config_path=str(self.home.config),
                        allowed_hosts=self.config.admin.allowed_hosts,
                        task_status=task_status,
                    )
                )
                await nursery.start(self.gateway.run)
                self.home.write_admin_address(admin_url, os.getpid())
                nursery.start_soon(self._diagnose_loneliness)
                if (interval := systemd.watchdog_interval_s()) is not None:
                    nursery.start_soon(systemd.keep_watchdog_fed, interval)
                print_banner(self.status(), admin_url, str(self.home.config), risks)
                nursery.start_soon(self._tell_when_serving, admin_url)
                task_status.started(admin_url)
                await trio.sleep_forever()
        finally:
            self.home.clear_admin_address()
            self.db.close()

    def _check_model_file(self) -> None:
        """A [market] model given as a file must be a readable GGUF before anything says
        "ready" (it used to print ready, then exit 1 once the import read the file)."""
        text = self.config.market.model
        if text:
            ref = ModelRef.parse(text, f"{self.home.config}: [market] model")
            if ref.kind == "path":
                path = Path(ref.value).expanduser()
                read_header(path)
                if self.config.inference.serve:
                    archs.check_file(path)

    async def _tell_when_serving(self, admin_url: str) -> None:
        """ "ready" (and Type=notify's READY=1) once the gateway can serve its model (at once
        on a node with no gateway or no model to serve). Until then the operator sees what
        it waits for, again when that changes, and systemd a STATUS= line (on each change,
        and well within START_EXTEND_S) with EXTEND_TIMEOUT_USEC= so that its start timeout
        fires only when this loop stops (a first download or a route may take long)."""
        shown, told = "", -START_EXTEND_S
        while True:
            ready, status = self._readiness()
            if ready:
                systemd.notify(f"READY=1\nSTATUS={status}")
                print_ready(self.p2p.peer_id, admin_url, status)
                return
            if status != shown:
                print_waiting(status)
            if status != shown or trio.current_time() - told >= START_EXTEND_S / 3:
                systemd.notify(f"STATUS={status}\nEXTEND_TIMEOUT_USEC={int(START_EXTEND_S * 1e6)}")
                shown, told = status, trio.current_time()
            await trio.sleep(READY_POLL_S)

    def _readiness(self) -> tuple[bool, str]:
        """Whether this node does what it is for now, and what it does or waits for."""
        if not self.config.gateway.enabled or not self.config.market.model:
            return True, f"running without a gateway model, peer id {self.p2p.peer_id}"
        health = self.gateway.health()
        if health.status == "ok":
            return True, f"gateway {self.gateway.url}: {health.reason}"
        return False, f"waiting ({health.status}): {health.reason}"

    async def _exchange_receipts(
        self, s: Settlement, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Settlement between peers: publish our wallet link, admit only paying gateways,
        deliver and take receipts, claim."""
        c = s.config.section
        self.market.link = s.link

        def rates() -> Rates:
            return Rates(
                self.inference.units_per_token(), s.prices.price, s.governance.params().floor
            )

        self.admission = Admission(
            self.p2p.peer_id,
            s.network,
            self.inference.link_of,
            s.receipts,
            s.stake,
            s.governance.params,
            max_unpaid=c.max_unpaid,
            rates=rates,
            cache_s=s.config.stake_cache_s,
        )
        self.inference.use_admission(self.admission)
        self.exchange = Exchange(
            s,
            self.p2p.peer_id,
            self.inference.channels.request,
            self.inference.link_of,
            self.admission,
            claim_threshold=c.claim_threshold,
        )
        self.inference.own_use = OwnUse(s, self.p2p.peer_id, self.exchange)
        self.inference.also_serve(SETTLE_PROTOCOL, self.exchange.handle)
        await self.exchange.run(task_status=task_status)

    async def _diagnose_loneliness(self) -> None:
        """Like Syncthing: say what to check when a node with a bootstrap list stays alone."""
        if not self.config.p2p.bootstrap:
            return
        await trio.sleep(NO_PEERS_DIAGNOSIS_S)
        while True:
            if len(self.p2p.peers) == 0:
                log.warning(
                    f"no peers after {NO_PEERS_DIAGNOSIS_S:g} s: check that the bootstrap "
                    f"addresses in {self.home.config} are reachable from this machine, that "
                    "the other node runs on the same network name, and that no firewall "
                    "blocks its port",
                    bootstrap=list(self.config.p2p.bootstrap),
                )
            await trio.sleep(300)


def _preferred_join(addrs: list[str]) -> str:
    """A TCP address other machines can use: non-loopback first, loopback as a last resort."""
    tcp = [a for a in addrs if "/tcp/" in a and "/ws" not in a] or addrs
    outside = [a for a in tcp if "/ip4/127." not in a and "/ip6/::1/" not in a]
    return (outside or tcp or [""])[0]


async def run_until_signal(node: Node) -> None:
    """Run the node; the first SIGTERM/SIGINT drains it, a second SIGINT exits at once.

    Draining starts with the market's goodbye, while every service still runs: cancelling
    the node first would end the gossip's sending tasks with the goodbye still queued, and
    peers would route to this node until its record's TTL ran out."""
    node_scope = trio.CancelScope()

    async def watch(signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            log.info(
                "stopping: closing peers and flushing state", signal=signal.Signals(signum).name
            )
            systemd.notify("STOPPING=1")
            with trio.move_on_after(GOODBYE_TIMEOUT_S + 1):  # its loops' ending, then the goodbye
                await node.market.leave()
            node_scope.cancel()
            break
        # py-libp2p's shielded teardown can block on a dead connection; our own state is
        # committed transaction by transaction, so a drain that overruns is cut short.
        with trio.move_on_after(DRAIN_TIMEOUT_S):
            async for signum in signals:
                if signum == signal.SIGINT:
                    log.warning("second interrupt: exiting without draining")
                    os._exit(130)
        log.warning(f"drain took longer than {DRAIN_TIMEOUT_S:g} s (libp2p teardown); exiting")
        node.home.clear_admin_address()
        os._exit(0)

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, signals)
            with node_scope:
                await node.run()
            nursery.cancel_scope.cancel()
