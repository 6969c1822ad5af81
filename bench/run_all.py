"""Every benchmark side by side in one run, written to bench/REPORT.md.

    .venv/bin/python bench/run_all.py [--quick] [--only NAME ...]

Each benchmark is its own script (run alone for details); this one runs them in turn
on the same machine, with bounded time each, and collects the tables they print with
the machine they ran on and the DESIGN.md targets beside them. A script that is
missing or fails is reported as such, never silently dropped.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass(frozen=True)
class Bench:
    name: str
    """Short name (for --only)."""
    title: str
    """Section heading in the report."""
    args: tuple[str, ...]
    """Script and arguments, relative to bench/."""
    quick: tuple[str, ...]
    """Cheaper arguments for --quick."""
    target: str
    """What DESIGN.md asks of it."""
    timeout_s: float = 900.0
    """Upper bound of its run."""


BENCHES = (
    Bench("daemon", "Daemon start-up, idle memory and CPU", ("bench_daemon.py",),
          ("bench_daemon.py", "--idle-s", "10", "--starts", "2"),
          "ready in seconds; idle cost small enough for an always-on service"),
    Bench("compute", "Single-node engine (decode, prefill, expert worker batching)",
          # One thread: on a shared 2-core box two ggml threads stall each other (measured
          # 6.5 vs 86 tok/s); llama.cpp, when built, runs with the same count.
          ("bench_compute.py", "--threads", "1"),
          ("bench_compute.py", "--threads", "1", "--decode", "32"),
          "decode >= 0.9x llama.cpp on the same GGUF and threads"),
    Bench("archs", "Architectures: llama.cpp vs kvasird logits per architecture and type",
          ("bench_archs.py",), ("bench_archs.py",),
          "top-1 and greedy tokens equal to llama.cpp; q8_0 logits bit for bit"),
    Bench("memory", "Memory per session per architecture at 4k and 32k, vs llama.cpp",
          ("bench_memory.py",), ("bench_memory.py", "--contexts", "4096"),
          "no more than llama.cpp for the same file and context"),
    Bench("scale", "Real widths: Llama-3.2-1B and Qwen3-30B-A3B shapes (Q4_K_M), vs llama.cpp",
          ("bench_scale.py",), ("bench_scale.py", "--quick"),
          "1 node >= 1.0x llama.cpp, ring >= 0.9x, MoE ring >= 0.7x, 16 sessions >= 3x one, "
          "a repeated 2k prompt's first token >= 5x faster", timeout_s=2400.0),
    Bench("swarm", "Ring and expert dispatch across daemons",
          ("bench_swarm.py",), ("bench_swarm.py",),
          "3-stage ring >= 0.75x llama.cpp monolithic decode; batching raises aggregate tok/s"),
    Bench("link", "One ring link: blocking socket, trio socket and our lane side by side",
          ("bench_link.py",), ("bench_link.py", "--rounds", "200", "--repeat", "1"),
          "the lane close to a bare socket; what is left is the machine's"),
    Bench("gateway", "HTTP gateway: time to first token, tokens/s, concurrency",
          ("bench_gateway.py",), ("bench_gateway.py",), "streaming overhead small vs compute"),
    Bench("shards", "Shard transfer", ("bench_shards.py", "--repeat", "2"),
          ("bench_shards.py",), ">= 100 MB/s on loopback"),
    Bench("market", "Coverage market: convergence and gossip bandwidth (real daemons)",
          ("bench_market.py", "--nodes", "5", "10", "20"),
          ("bench_market.py", "--nodes", "5", "10", "--steady-s", "20"),
          "every unit at target replicas; bandwidth per node reported"),
    Bench("market-sim", "Coverage market at internet scale (simulation)",
          ("sim_market.py", "sim"), ("sim_market.py", "sim", "--nodes", "250", "1000"),
          "full coverage at 1,000 and 10,000 nodes; what breaks first"),
    Bench("settlement", "Settlement latency and claims", ("bench_settlement.py", "--n", "100"),
          ("bench_settlement.py", "--n", "30"), "quote -> pay -> verify well under a second"),
    Bench("money", "Paid requests through real daemons: settlement cost, receipts, claims",
          ("bench_money.py", "--rounds", "10"), ("bench_money.py", "--rounds", "4"),
          "being paid adds nothing measurable to a decode step; receipts off the token path"),
    Bench("metering", "The serving peers' meter: a metered ring against an unmetered one",
          ("bench_metering.py", "--pairs", "12"), ("bench_metering.py", "--pairs", "6"),
          "metering costs <= 3 % of decode tok/s (paired)"),
    Bench("spotcheck", "Spot checks of ring stages: generations at rates 0, 0.1 (default), 1",
          ("bench_spotcheck.py",), ("bench_spotcheck.py", "--rounds", "2"),
          "the default rate's cost stated; nothing honest flagged"),
    Bench("relay", "Relayed vs direct RTT and throughput", ("bench_relay.py",),
          ("bench_relay.py",), "relayed path usable for latency-tolerant work"),
    Bench("cli", "Command-line start-up: --version, status, peers",
          ("bench_cli.py", "--runs", "15"), ("bench_cli.py", "--runs", "5"),
          "under 0.3 s for --version, status and peers"),
    Bench("replay", "Exact failover replay: one position at a time against one batch",
          ("bench_replay.py", "--rounds", "5"), ("bench_replay.py", "--rounds", "2"),
          "a failover continues with the bits of an undisturbed run; cost per replayed token"),
    Bench("fuzz", "A node under fuzz from foreign peers", ("fuzz_peer.py", "--seconds", "60"),
          ("fuzz_peer.py", "--seconds", "20"),
          "the node stays up and answers every request while fuzzed"),
    Bench("soak", "Churn soak: kills, restarts and a slowed node under four clients",
          ("soak.py", "--seconds", "300"), ("soak.py", "--seconds", "90"),
          ">= 99 % of requests complete, every greedy output the undisturbed one",
          timeout_s=1200.0),
)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) // 1024 // 1024 for line in open("/proc/meminfo")
                if line.startswith("MemTotal")), 0)
    return (f"{cpu}, {os.cpu_count()} cores, {mem} GiB RAM, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}")


def run(bench: Bench, quick: bool) -> tuple[str, float, str]:
    args = bench.quick if quick else bench.args
    script = BENCH / args[0]
    if not script.exists():
        return "missing", 0.0, f"{script.name} does not exist yet"
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(script), *args[1:]], cwd=ROOT,
                              capture_output=True, text=True, timeout=bench.timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return "timed out", bench.timeout_s, out
    status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    text = done.stdout if done.returncode == 0 else done.stdout + "\n" + done.stderr[-3000:]
    return status, time.monotonic() - start, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="cheaper settings for each")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHES])
    parser.add_argument("--out", type=Path, default=BENCH / "REPORT.md")
    args = parser.parse_args()
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    sections = [f"# kvasird benchmark report\n\nMachine: {machine()}  \n"
                f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                f"{' (quick)' if args.quick else ''}, one benchmark after another.\n"]
    summary = ["| benchmark | status | seconds | target |", "|---|---|---|---|"]
    for bench in chosen:
        print(f"[run_all] {bench.name} ...", file=sys.stderr, flush=True)
        status, seconds, text = run(bench, args.quick)
        summary.append(f"| {bench.name} | {status} | {seconds:.0f} | {bench.target} |")
        sections.append(f"## {bench.title}\n\nTarget: {bench.target}. Status: {status}.\n\n"
                        f"```\n{text.strip()}\n```\n")
    report = sections[0] + "\n" + "\n".join(summary) + "\n\n" + "\n".join(sections[1:])
    args.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
