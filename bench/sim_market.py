"""The coverage market at internet scale, by simulation: N virtual nodes, the 122B MoE.

    nice .venv/bin/python bench/sim_market.py run [--nodes 250 1000 10000] [--duration 900]
    nice .venv/bin/python bench/sim_market.py plot          # table + PNG from saved results

``run`` simulates each size with kvasird_dev.marketsim (the real records, map, demand and
decide over a simulated gossip layer; see that module for what is approximated) and
saves one JSON per size under bench/out/; ``plot`` (run after ``run``) prints the
table, writes it as Markdown (bench/out/market_sim.md) and draws bench/out/market_sim.png.
The PNG needs matplotlib, which is not a kvasird dependency (``pip install matplotlib``
into the venv); the table does not.

Every run has churn events (by default 5 % of the nodes leave silently and as many join,
once a minute) and lognormal budgets. Besides what was simulated, the table shows what
expert holdings as one 256-bit bitmap per layer (when smaller than the ranges) would make
of the records: the measured sizes that decide whether a denser encoding pays.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvasird.market.records import CoverageRecord
from kvasird.wire import pack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvasird_dev (not installed)
from kvasird_dev.marketsim import MarketSim, SimConfig, SimResult, qwen122b  # noqa: E402

OUT = Path(__file__).parent / "out"


def bitmap_bytes(record: CoverageRecord) -> int:
    """msgpack size of the record with each layer's expert ranges as one bitmap if smaller."""
    by_layer: dict[int, list[list[Any]]] = {}
    other = []
    for h in record.holdings:
        if h.kind == "E":
            by_layer.setdefault(h.start, []).append(h.to_wire())
        else:
            other.append(h.to_wire())
    holdings = list(other)
    for layer, ranges in by_layer.items():
        bitmap = ["B", layer, b"\0" * 32, ranges[0][-1]]
        holdings += ranges if len(pack(ranges)) <= len(pack([bitmap])) else [bitmap]
    return len(pack({**record.to_wire(), "holdings": holdings}))


def summarize(sim: MarketSim, result: SimResult) -> dict[str, Any]:
    """Everything the table and the plot need, as plain JSON."""
    cfg, g = result.config, result.gossip
    alive = [n for n in sim.nodes if n.alive and n.record is not None]
    holding = [n for n in alive if n.held]
    idle = [n for n in alive if not n.held]
    mean_holding = float(np.mean([n.wire_bytes for n in holding])) if holding else 0.0
    mean_idle = float(np.mean([n.wire_bytes for n in idle])) if idle else 0.0
    bitmap = [bitmap_bytes(n.record) for n in holding]
    # after the first full coverage: what churn does to a covered network
    def after_cover(series: tuple[float, ...]) -> list[float]:
        return [f for k, f in enumerate(series)
                if result.t_covered is not None and (k + 1) * cfg.churn_every_s > result.t_covered]

    churned = after_cover(result.online_after_churn)
    servable = after_cover(result.servable_after_churn)
    replicas = result.expert_replicas.ravel()
    targets = result.expert_targets.ravel()
    return {
        "nodes": cfg.nodes, "duration_s": cfg.duration_s, "seed": cfg.seed,
        "t_covered": result.t_covered, "t_online": result.t_online,
        "t_online_99": next((x.t for x in result.samples if x.online >= 0.99), None),
        "samples": [[s.t, s.covered, s.online, s.nodes, s.holding] for s in result.samples],
        "replicas_min": int(replicas.min()), "replicas_median": float(np.median(replicas)),
        "replicas_max": int(replicas.max()),
        "replicas_hist": np.bincount(replicas).tolist(),
        "over_2x_target": float((replicas > 2 * targets).mean()),
        "replica_ratio": float(replicas.sum() / targets.sum()),
        "hot_mean": float(replicas[targets > cfg.target_replicas].mean()),
        "cold_mean": float(replicas[targets == cfg.target_replicas].mean()),
        "layer_min": int(result.layer_replicas.min()),
        "layer_max": int(result.layer_replicas.max()), "head": int(result.head_replicas),
        "alive": len(alive), "holding": len(holding),
        "record_mean": g.record_bytes, "envelope_mean": g.envelope_bytes,
        "record_holding_mean": mean_holding, "record_idle_mean": mean_idle,
        "bitmap_holding_mean": float(np.mean(bitmap)) if bitmap else 0.0,
        "bitmap_max": max(bitmap, default=0),
        "max_holdings": result.max_holdings, "max_record_bytes": result.max_record_bytes,
        "records_per_min": g.records_per_min, "changes_per_min": g.changes_per_min,
        "unique_per_node_min": g.unique_per_node_min, "mesh_per_node_min": g.mesh_per_node_min,
        "ihave_per_node_min": g.ihave_per_node_min, "total_per_node_min": g.total_per_node_min,
        "p99_per_node_min": g.p99_per_node_min, "suspicions_per_min": g.suspicions_per_min,
        "peak_per_node_min": result.gossip_peak_per_node_min,
        "online_after_churn": list(result.online_after_churn),
        "online_after_churn_mean": float(np.mean(churned)) if churned else None,
        "online_after_churn_min": float(np.min(churned)) if churned else None,
        "servable_after_churn_mean": float(np.mean(servable)) if servable else None,
        "servable_after_churn_min": float(np.min(servable)) if servable else None,
        "sync_mb_per_join": result.sync_bytes_per_join / 1e6,
        "map_mb": result.map_bytes / 1e6,
        "decisions": result.decisions,
        "decide_ms": 1e3 * result.decide_s / max(result.decisions, 1),
        "apply_us": result.apply_us, "validate_us": result.validate_us,
        "rejected": result.rejected, "over_budget": result.over_budget,
        "left": result.left, "arrived": result.arrived, "wall_s": result.wall_s,
    }


def run(sizes: list[int], tag: str, **config: Any) -> None:
    """Simulate each size; ``tag`` names a variant (kept out of the scaling plot)."""
    OUT.mkdir(parents=True, exist_ok=True)
    model = qwen122b()
    print(report([]), flush=True)
    for n in sizes:
        cfg = SimConfig(nodes=n, **config)
        print(f"simulating {n} nodes for {cfg.duration_s:g} s {tag} ...", flush=True)
        sim = MarketSim(cfg, model)
        summary = {**summarize(sim, sim.run()), "tag": tag,
                   "variant": {k: v for k, v in config.items() if k != "duration_s"}}
        (OUT / f"sim_{n}{'_' + tag if tag else ''}.json").write_text(json.dumps(summary))
        print(row(summary), flush=True)


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


COLUMNS = ("nodes", "covered s", "online 99%/100% s", "expert replicas min/med/max",
           "hot/cold mean", "replicas/target", "experts > 2x target", "layers min/max", "head",
           "holding", "record B (mean/max)", "max ranges", "records/min (changes)",
           "suspicions/min", "MB/node/min mean/p99 (peak)", "online 60 s after churn mean/min",
           "servable 60 s after churn mean/min",
           "map MB/node", "sync MB/join", "decide ms", "apply µs", "validate µs", "wall s")


def row(s: dict[str, Any]) -> str:
    def seconds(key: str) -> str:
        return f"{s[key]:.0f}" if s[key] is not None else f"> {s['duration_s']:.0f}"

    cells = [
        f"{s['nodes']:,} {s.get('tag', '')}".strip(), seconds("t_covered"),
        f"{seconds('t_online_99')}/{seconds('t_online')}",
        f"{s['replicas_min']}/{s['replicas_median']:.0f}/{s['replicas_max']}",
        f"{s['hot_mean']:.1f}/{s['cold_mean']:.1f}", f"{s['replica_ratio']:.2f}",
        f"{s['over_2x_target']:.1%}", f"{s['layer_min']}/{s['layer_max']}", f"{s['head']}",
        f"{s['holding']:,}/{s['alive']:,}", f"{s['record_mean']:.0f}/{s['max_record_bytes']:,}",
        f"{s['max_holdings']:,}", f"{s['records_per_min']:,.0f} ({s['changes_per_min']:,.0f})",
        f"{s['suspicions_per_min']:.0f}",
        f"{_mb(s['total_per_node_min'])}/{_mb(s['p99_per_node_min'])} "
        f"({_mb(s['peak_per_node_min'])})", _fraction(s, "online_after_churn"),
        _fraction(s, "servable_after_churn"),
        f"{s['map_mb']:.1f}", f"{s['sync_mb_per_join']:.1f}", f"{s['decide_ms']:.0f}",
        f"{s['apply_us']:.0f}",
        f"{s['validate_us']:.0f}", f"{s['wall_s']:.0f}"]
    return "| " + " | ".join(cells) + " |"


def _fraction(s: dict[str, Any], key: str) -> str:
    if s[key + "_mean"] is None:
        return "-"
    return f"{s[key + '_mean']:.2%}/{s[key + '_min']:.2%}"


def load() -> list[dict[str, Any]]:
    found = [json.loads(p.read_text()) for p in OUT.glob("sim_*.json")]
    return sorted(found, key=lambda s: (bool(s.get("tag")), s.get("tag", ""), s["nodes"]))


def plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("the plot needs matplotlib, which kvasird does not depend on: "
                 ".venv/bin/pip install matplotlib (the table above is complete without it)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [s for s in results if not s.get("tag")]
    fig, ((cov, hist, piles), (gossip, times, records)) = plt.subplots(2, 3, figsize=(18, 9.5))
    for s in results:
        t = np.array(s["samples"])
        line, = cov.plot(t[:, 0] / 60, t[:, 1], label=f"{s['nodes']:,} nodes")
        cov.plot(t[:, 0] / 60, t[:, 2], ls="--", color=line.get_color())
        h = np.array(s["replicas_hist"], dtype=float)
        hist.step(np.arange(len(h)), np.where(h > 0, h, np.nan), where="mid",
                  label=f"{s['nodes']:,} nodes")
    cov.set(xlabel="minutes", ylabel="fraction of units at target",
            title="Coverage (solid: joining/loading/online count; dashed: online only)")
    cov.legend()
    hist.set(xlabel="active replicas per expert (end of run)", ylabel="experts", yscale="log",
             xscale="log", title="Replica distribution (12,544 experts; targets 2..6)")
    hist.legend()
    n = [s["nodes"] for s in results]
    piles.plot(n, [s["replicas_max"] for s in results], "o-", label="max replicas of an expert")
    piles.plot(n, [s["replicas_median"] for s in results], "s-", label="median replicas")
    piles.plot(n, [s["hot_mean"] for s in results], "^-", label="mean replicas, hot experts")
    piles.axhline(6, color="grey", lw=0.8, ls=":", label="largest target (hot expert)")
    piles.set(xscale="log", yscale="log", xlabel="nodes", ylabel="replicas",
              title="Pile-ups: replicas beyond the target")
    piles.legend(fontsize=8)
    gossip.plot(n, [s["total_per_node_min"] / 1e6 for s in results], "o-",
                label="mean node (mesh copies + IHAVE + GRAFT/PRUNE)")
    gossip.plot(n, [s["p99_per_node_min"] / 1e6 for s in results], "^-",
                label="99th percentile of nodes and minutes")
    gossip.plot(n, [s["unique_per_node_min"] / 1e6 for s in results], "s:",
                label="one copy of each message")
    gossip.set(xscale="log", yscale="log", xlabel="nodes", ylabel="MB per node per minute",
               title="Coverage gossip received per node")
    gossip.legend(fontsize=8)
    times.plot(n, [s["t_covered"] or np.nan for s in results], "o-",
               label="every unit at target (counting joining)")
    times.plot(n, [s["t_online_99"] or np.nan for s in results], "^-",
               label="99% of units at target, online")
    times.plot(n, [s["t_online"] or np.nan for s in results], "s-",
               label="every unit at target, online")
    times.set(xscale="log", xlabel="nodes", ylabel="seconds after the first boot",
              title=f"Time to full coverage (missing points: > {results[0]['duration_s']:.0f} s)")
    times.legend(fontsize=8)
    records.plot(n, [s["record_holding_mean"] for s in results], "o-",
                 label="mean record of a holding node")
    records.plot(n, [s["max_record_bytes"] for s in results], "s-", label="largest record")
    records.plot(n, [s["bitmap_holding_mean"] for s in results], "^--",
                 label="mean, holdings as per-layer bitmaps")
    records.plot(n, [s["bitmap_max"] for s in results], "v--", label="largest, as bitmaps")
    records.set(xscale="log", yscale="log", xlabel="nodes", ylabel="bytes (msgpack)",
                title="Coverage record size")
    records.legend(fontsize=8)
    fig.suptitle("kvasird coverage market, simulated: Qwen3.5-122B-shaped MoE (49 x 256 experts),"
                 " 5 % churn a minute, 1% loss, lognormal budgets (median 2 GB)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def report(results: list[dict[str, Any]]) -> str:
    header = "| " + " | ".join(COLUMNS) + " |"
    return "\n".join([header, "|" + "---|" * len(COLUMNS)] + [row(s) for s in results])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("run", aliases=["sim"], help="simulate and save bench/out/sim_<N>.json")
    sim.add_argument("--nodes", type=int, nargs="+", default=[250, 1000, 10000])
    sim.add_argument("--duration", type=float, default=900.0, help="simulated seconds")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--tag", default="", help="name of a variant (sensitivity runs)")
    for name in ("hop_latency_s", "loss", "skew", "churn", "rebalance_s"):
        sim.add_argument("--" + name.replace("_", "-"), type=float, default=None)
    sub.add_parser("plot", help="table and PNG from the saved results")
    args = parser.parse_args()
    if args.command in ("run", "sim"):
        variant = {k: getattr(args, k) for k in
                   ("hop_latency_s", "loss", "skew", "churn", "rebalance_s")
                   if getattr(args, k) is not None}
        run(args.nodes, args.tag, duration_s=args.duration, seed=args.seed, **variant)
        return
    results = load()
    table = report(results)
    print(table)
    (OUT / "market_sim.md").write_text(table + "\n")
    plot(results, OUT / "market_sim.png")
    print(f"-> {OUT / 'market_sim.md'}, {OUT / 'market_sim.png'}")


if __name__ == "__main__":
    main()
