"""Coverage market on real daemons: time to convergence and gossip bytes per node per minute.

    nice .venv/bin/python bench/bench_market.py [--nodes 5 10 20] [--steady-s 60] [--heartbeat-s 1]
                                                [--p2p-defaults]

Each size starts its own LocalNet on 127.0.0.1 (node i bootstraps from node i-1) with a
generated 8-layer x 64-expert MoE (Q8_0, ~58 MiB), target 2 replicas, budgets of 1.5x
the fair share, and the loopback timings of the integration test (a 1 s market heartbeat,
so keep-alives every 3 s at 10 nodes, every 60 s from 960 nodes on (kvasird.market.publish);
rebalance every 2 s, enrollment delay up to 3 s).

Convergence is the time from "every daemon is ready" until node 0's GET /v0/coverage
says ``fully_covered``, then until every node's does (each bounded by 180 s; a row
says how many nodes still see full coverage after the bandwidth window).

Bandwidth is then measured over a steady-state window with nothing else talking to the
daemons: the TCP payload bytes each daemon's established sockets sent and received
(``ss -tinp``: ``bytes_sent`` / ``bytes_received`` of the kernel's tcp_info, so Noise
and yamux framing included, TCP/IP headers not). That is *all* p2p traffic of the
daemon: coverage records, gossipsub control (GRAFT/PRUNE/IHAVE/IWANT each gossipsub
heartbeat), liveness pings and peer exchange, each every second on a loopback network.
The coverage-record payload alone is shown beside it: the msgpack size of each node's
current record (rebuilt from the holdings node 0 sees) times keep-alives per minute, one
copy of each (gossipsub delivers up to D copies, plus envelopes): the floor a network
with no changes pays.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvasird import PROTOCOL_VERSION, __version__
from kvasird.config.schema import P2PConfig
from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNetError, LocalNode
from kvasird.market.model import MarketModel
from kvasird.market.publish import keepalive_s, record_ttl
from kvasird.market.records import Capabilities, CoverageRecord, Holding
from kvasird.model.manifest import Manifest
from kvasird.wire import pack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvasird_dev (not installed)
from kvasird_dev.testmodels import make_model  # noqa: E402

HEARTBEAT_S = 1.0
CONVERGE_TIMEOUT_S = 180.0
READY_TIMEOUT_S = 180.0
SETTLE_S = 10.0
_SS_BYTES = re.compile(r"bytes_(sent|received):(\d+)")
_SS_PID = re.compile(r"pid=(\d+)")


@dataclass(frozen=True)
class Result:
    nodes: int
    """Daemons in the network."""
    up_s: float
    """Seconds from spawning the first daemon until all report ready."""
    node0_s: float | None
    """Seconds from ready until node 0's map is fully covered; None: not within the timeout."""
    all_s: float | None
    """Seconds from ready until every node's map is fully covered; None: not in time."""
    covered_after: int
    """Nodes whose map is fully covered at the end of the bandwidth window."""
    tcp_kib_min: float
    """Mean TCP payload (sent + received) per daemon per minute, KiB."""
    tcp_sent_kib_min: float
    """Mean TCP payload sent per daemon per minute, KiB."""
    record_bytes: float
    """Mean msgpack size of a coverage record at steady state."""
    record_kib_min: float
    """Keep-alive payload one node receives per minute (one copy of each), KiB."""
    max_held_fraction: float
    """Largest held/budget ratio over the nodes (must stay <= 1)."""


def up(net: LocalNet) -> None:
    """LocalNet.up, with a longer wait for readiness.

    Each daemon imports (hashes) the model at start; on a shared 2-core machine ten of
    them at once take longer than the launcher's 30 s.
    """
    previous = ""
    for node in net.nodes:
        previous = net.configure(node, [previous] if previous else [])
    for node in net.nodes:
        node.spawn()
    for node in net.nodes:
        node.wait_ready(READY_TIMEOUT_S)


def covered(node: LocalNode) -> bool:
    """Whether the node's map has every unit at its target (False while it starts up)."""
    return bool(node.get("/v0/coverage").get("fully_covered"))


def timed(net: LocalNet, predicate: Callable[[], bool]) -> float | None:
    """Seconds until ``predicate`` holds, None if not within CONVERGE_TIMEOUT_S."""
    try:
        return net.wait_until("the market converges", predicate, CONVERGE_TIMEOUT_S)
    except LocalNetError:
        return None


def tcp_bytes(pids: set[int]) -> dict[int, tuple[int, int]]:
    """(bytes sent + received, bytes sent) on each process's established TCP sockets now."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                         text=True, timeout=10, check=True).stdout
    totals = {pid: 0 for pid in pids}
    sent = {pid: 0 for pid in pids}
    owner: int | None = None
    for line in out.splitlines():
        pid = _SS_PID.search(line)
        if pid:
            owner = int(pid.group(1)) if int(pid.group(1)) in pids else None
            continue
        if owner is None:
            continue
        for kind, value in _SS_BYTES.findall(line):
            totals[owner] += int(value)
            if kind == "sent":
                sent[owner] += int(value)
    return {pid: (totals[pid], sent[pid]) for pid in pids}


def record_size(peer: str, view: dict[str, Any], addrs: tuple[str, ...], caps: Capabilities,
                peers: int, heartbeat_s: float) -> int:
    """The msgpack size of the record `peer` publishes, rebuilt from node 0's map."""
    record = CoverageRecord(
        peer=peer, seq=time.time_ns() // 1_000_000, ts=time.time(),
        ttl=record_ttl(heartbeat_s, peers),
        state=view["state"], protocol=PROTOCOL_VERSION, version=__version__, addrs=addrs,
        model="0" * 64 if view["holdings"] else "", budget=view["budget"],
        holdings=tuple(Holding.from_wire(h) for h in view["holdings"]), caps=caps)
    return len(pack(record.to_wire()))


def shipped_p2p() -> dict[str, float]:
    """The p2p timings a daemon ships with (config defaults), instead of LocalNet's loopback
    ones (pings and peer exchange every second), whose traffic hides the records'."""
    p2p = P2PConfig()
    return {f"p2p.{name}": getattr(p2p, name) for name in
            ("heartbeat_interval_s", "liveness_timeout_s", "peer_exchange_interval_s")}


def run(n: int, model_path: Path, model: MarketModel, root: Path, steady_s: float,
        heartbeat_s: float = HEARTBEAT_S, p2p_defaults: bool = False) -> Result:
    budget_mb = int(2 * model.total_bytes * 1.5 / n / 2**20) + 1
    settings = {"market.model": str(model_path), "market.memory_budget_mb": budget_mb,
                "market.heartbeat_s": heartbeat_s, "market.rebalance_s": 2.0,
                "market.enroll_delay_s": 3.0, "market.target_replicas": 2,
                **(shipped_p2p() if p2p_defaults else {})}
    with LocalNet(root / f"net{n}", n, settings=settings) as net:
        start = time.monotonic()
        up(net)
        up_s = time.monotonic() - start
        node0_s = timed(net, lambda: covered(net.nodes[0]))
        rest = None if node0_s is None else timed(net, lambda: all(
            covered(node) for node in net.nodes))
        all_s = None if node0_s is None or rest is None else node0_s + rest
        time.sleep(SETTLE_S)
        pids = {node.proc.pid for node in net.nodes if node.proc is not None}
        before, t0 = tcp_bytes(pids), time.monotonic()
        time.sleep(steady_s)
        after, t1 = tcp_bytes(pids), time.monotonic()
        per_min = 60.0 / (t1 - t0)
        tcp = sum(after[p][0] - before[p][0] for p in pids) / len(pids) * per_min
        sent = sum(after[p][1] - before[p][1] for p in pids) / len(pids) * per_min
        view = net.nodes[0].get("/v0/coverage")
        status = net.nodes[0].status()
        addrs = tuple(status["listen_addrs"])[:16]
        sizes = [record_size(peer, holder, addrs, Capabilities(), n, heartbeat_s)
                 for peer, holder in view["holders"].items()]
        records_per_min = 60.0 / keepalive_s(heartbeat_s, n)
        held = [node.get("/v0/coverage") for node in net.nodes]
    return Result(
        nodes=n, up_s=up_s, node0_s=node0_s, all_s=all_s,
        covered_after=sum(1 for v in held if v.get("fully_covered")), tcp_kib_min=tcp / 1024,
        tcp_sent_kib_min=sent / 1024, record_bytes=sum(sizes) / len(sizes),
        record_kib_min=sum(sizes) * records_per_min / 1024,
        max_held_fraction=max(v["held_bytes"] / v["budget_bytes"] for v in held))


def seconds(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else f"> {CONVERGE_TIMEOUT_S:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--steady-s", type=float, default=60.0,
                        help="length of the bandwidth window, after convergence")
    parser.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S,
                        help="[market] heartbeat_s of every daemon")
    parser.add_argument("--p2p-defaults", action="store_true",
                        help="the daemon's shipped p2p timings (heartbeat 5 s, peer exchange "
                        "10 s) instead of the loopback ones (both every second)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="run under this directory (logs kept) instead of a temporary one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.keep or Path(tmp)).resolve()
        model_path = make_model(root / "moe.gguf", n_layer=8, n_expert=64, n_embd=128,
                                n_ff_exp=256, dtype="q8_0", tied_output=True)
        model = MarketModel.from_manifest(Manifest.from_gguf(model_path))
        print(f"model: 8 layers x 64 experts, {model.total_bytes / 2**20:.1f} MiB; records on "
              f"change, keep-alives every {keepalive_s(args.heartbeat_s, min(args.nodes)):g} s or "
              f"more; steady window {args.steady_s:g} s", flush=True)
        header = (f"{'nodes':>5} {'up s':>6} {'node0 covered s':>15} {'all covered s':>13} "
                  f"{'covered at end':>14} "
                  f"{'TCP KiB/node/min':>16} {'(sent)':>8} {'record B':>8} "
                  f"{'keep-alive KiB/node/min':>23} {'max held/budget':>15}")
        rows = []
        for n in args.nodes:
            r = run(n, model_path, model, root, args.steady_s, args.heartbeat_s,
                    args.p2p_defaults)
            rows.append(f"{r.nodes:5d} {r.up_s:6.1f} {seconds(r.node0_s):>15} "
                        f"{seconds(r.all_s):>13} {f'{r.covered_after}/{r.nodes}':>14} "
                        f"{r.tcp_kib_min:16.0f} {r.tcp_sent_kib_min:8.0f} {r.record_bytes:8.0f} "
                        f"{r.record_kib_min:23.1f} {r.max_held_fraction:15.2f}")
            print(rows[-1], flush=True)
        print(header)
        print("\n".join(rows))


if __name__ == "__main__":
    main()
