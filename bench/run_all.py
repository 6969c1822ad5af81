"""Every benchmark on one machine, each run's result kept, bench/REPORT.md built from them.

    .venv/bin/python bench/run_all.py [--quick] [--only NAME ...] [--timeout-s S]

Each benchmark is its own script (run alone for details). A run of one writes its result to
bench/results/NAME.json (committed): the script's table, the machine, when, how long, and
whether it met its DESIGN.md target, judged from numbers its table prints. The report is
then rebuilt from every stored result, whatever run left it: one section per benchmark with
its latest table only, and a summary drawn from those same results, so the two cannot
disagree. ``--only`` reruns some and keeps the rest as stored; earlier runs are in git's
history, not appended to the report. A script that is missing, fails or runs past its bound
is reported as such, never silently dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"


@dataclass(frozen=True)
class Check:
    """A value a benchmark's output prints, held against its target."""

    label: str
    """What the value is, as the verdict names it."""
    pattern: str
    """Regular expression (one line at a time); its first group is the value, on every line
    it matches (every row of a table must pass)."""
    least: float = -math.inf
    """The smallest number that meets the target."""
    most: float = math.inf
    """The largest number that meets the target."""
    equals: str | None = None
    """The text the value must read instead of a number (a yes/no or True/False column)."""

    def held(self, output: str) -> list[tuple[str, bool]] | None:
        """Each value the output shows, said with its target, and whether it meets it; None
        when the output shows no such value, as when llama.cpp (a ratio's reference) is not
        built."""
        found = re.findall(self.pattern, output, re.MULTILINE)
        if not found:
            return None
        if self.equals is not None:
            return [(f"{self.label} {value} (target {self.equals})", value == self.equals)
                    for value in found]
        bound = f">= {self.least:g}" if self.least > -math.inf else f"<= {self.most:g}"
        return [(f"{self.label} {value} (target {bound})", self.least <= float(value) <= self.most)
                for value in found]


@dataclass(frozen=True)
class Bench:
    """A benchmark script, how this one runs it, and the target its verdict holds it to."""

    name: str
    """Short name (for --only; names its result file)."""
    title: str
    """Section heading in the report."""
    args: tuple[str, ...]
    """Script and arguments, relative to bench/."""
    quick: tuple[str, ...]
    """Cheaper arguments for --quick."""
    target: str
    """What DESIGN.md (or the issue that added the benchmark) asks of it."""
    checks: tuple[Check, ...] = ()
    """The target's numbers in the output; none where the target is not a number."""
    timeout_s: float = 900.0
    """Upper bound of its run."""


@dataclass(frozen=True)
class Result:
    """One benchmark's latest run, as bench/results/NAME.json stores it."""

    name: str
    """The benchmark's short name."""
    command: str
    """The command line that ran, from the checkout's root."""
    quick: bool
    """Whether it ran with the cheaper --quick arguments."""
    machine: str
    """CPU, cores, memory, OS and Python of the machine it ran on."""
    commit: str
    """The checkout's commit, and whether the package had uncommitted changes."""
    started: str
    """When it started, UTC ("YYYY-MM-DD HH:MM")."""
    seconds: float
    """How long it ran."""
    verdict: str
    """One of VERDICTS: the summary's column and the section's status."""
    why: str
    """What the verdict rests on: the numbers that missed, or why none were judged."""
    output: str
    """What the script printed (and, when it failed, the end of its stderr)."""


VERDICTS = ("met", "not met", "unjudged", "failed", "timed out", "missing", "not run")
"""A run's outcome against its target; "unjudged": it ran, but its output holds no number
the target names (a qualitative target, or llama.cpp not built for a ratio to it)."""


def scale(label: str, row: str, least: float) -> Check:
    """One ``ROW D.DDx`` ratio of the ``scale:`` line that ends bench_scale.py's output; its
    0.00x stands for a ratio with no llama.cpp to hold it to, and is not judged."""
    return Check(label, rf"^scale:.*[:,] {re.escape(row)} (?!0\.00x)([\d.]+)x", least)


BENCHES = (
    Bench("daemon", "Daemon start-up, idle memory and CPU", ("bench_daemon.py",),
          ("bench_daemon.py", "--idle-s", "10", "--starts", "2"),
          "ready in seconds; idle cost small enough for an always-on service"),
    Bench("compute", "Single-node engine (decode, prefill, expert worker batching)",
          # One thread: on a shared 2-core box two ggml threads stall each other;
          # llama.cpp, when built, runs with the same count.
          ("bench_compute.py", "--threads", "1"),
          ("bench_compute.py", "--threads", "1", "--decode", "32"),
          "decode >= 0.9x llama.cpp on the same GGUF and threads",
          (Check("decode vs llama.cpp", r"^decode tokens/s +[\d.]+ +[\d.]+ +([\d.]+)x", 0.9),)),
    Bench("archs", "Architectures: llama.cpp vs kvasird logits per architecture and type",
          ("bench_archs.py",), ("bench_archs.py",),
          "top-1 and greedy tokens equal to llama.cpp; q8_0 logits bit for bit",
          (Check("top-1 agreement", r"^.{20} \S+ +[\d.]+ +([\d.]+) ", 1.0),
           Check("q8_0 max |delta|", r"^.{20} q8_0 +[\d.]+ +[\d.]+ +([-+\d.e]+) ", most=0.0))),
    Bench("memory", "Memory per session per architecture at 4k and 32k, vs llama.cpp",
          ("bench_memory.py",), ("bench_memory.py", "--contexts", "4096"),
          "no more than llama.cpp for the same file and context",
          (Check("kvasird / llama.cpp", r"^\S+ +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)$",
                 most=1.0),)),
    Bench("scale", "Real widths: Llama-3.2-1B and Qwen3-30B-A3B shapes (Q4_K_M), vs llama.cpp",
          ("bench_scale.py",), ("bench_scale.py", "--quick"),
          "1 node >= 1.0x llama.cpp, ring >= 0.9x, MoE ring >= 0.7x, 16 sessions >= 3x one, "
          "a repeated 2k prompt's first token >= 5x faster",
          (scale("1 node vs llama.cpp", "1node", 1.0), scale("ring vs llama.cpp", "ring", 0.9),
           scale("MoE ring vs llama.cpp", "moe-ring", 0.7),
           scale("16 sessions vs one", "sessions16", 3.0),
           scale("repeated 2k prompt's TTFT speed-up", "prefix-ttft", 5.0)),
          timeout_s=2400.0),
    Bench("swarm", "Ring and expert dispatch across daemons",
          ("bench_swarm.py",), ("bench_swarm.py",),
          "3-stage ring >= 0.75x llama.cpp monolithic decode; batching raises aggregate tok/s",
          (Check("3-stage ring vs llama.cpp",
                 r"^\| 3-stage ring \| [\d.]+ \| [^|]* \| ([\d.]+)x \|", 0.75),)),
    Bench("wan", "The 3-stage ring across emulated WAN links (root: network namespaces)",
          ("bench_wan.py",), ("bench_wan.py", "--quick"),
          "at 20 ms a link: a draft model >= 2.5x and prompt lookup >= 1.5x the ring's tok/s; "
          "TTFT at 40 ms <= at 0 + 0.13 s; 1 % loss p99 gap <= 1.5x; 8 sessions >= 4x one, "
          "batching at every hop",
          (Check("draft model over none at 20 ms", r"^wan: .*spec20 ([\d.]+)x", 2.5),
           Check("lookup over none at 20 ms (edits)", r"^wan: .*lookup20 ([\d.]+)x", 1.5),
           Check("TTFT at 40 ms minus at 0, s", r"^wan: .*ttft40 (-?[\d.]+)s", most=0.13),
           Check("p99 gap with 1 % loss over without", r"^wan: .*lossgap20 ([\d.]+)x",
                 most=1.5),
           Check("8 sessions over one", r"^wan: .*sessions8 ([\d.]+)x", 4.0),
           Check("batches at every hop", r"^batches > 0 at every hop: (\S+)$", equals="yes")),
          timeout_s=3600.0),
    Bench("speculate", "Speculation on loopback: one node and a 3-stage ring, auto over off",
          ("bench_speculate.py",), ("bench_speculate.py", "--rounds", "4", "--tokens", "64"),
          "the adaptive k never makes a generation slower than 0.97x without speculation",
          (Check("worst auto over off", r"^speculate-loopback: worst ([\d.]+)x", 0.97),),
          timeout_s=1800.0),
    Bench("link", "One ring link: blocking socket, trio socket and our lane side by side",
          ("bench_link.py",), ("bench_link.py", "--rounds", "200", "--repeat", "1"),
          "the lane close to a bare socket; what is left is the machine's"),
    Bench("gateway", "HTTP gateway: time to first token, tokens/s, concurrency",
          ("bench_gateway.py",), ("bench_gateway.py",), "streaming overhead small vs compute"),
    Bench("shards", "Shard transfer", ("bench_shards.py", "--repeat", "2"),
          ("bench_shards.py",), ">= 100 MB/s on loopback",
          (Check("shard download MB/s", r"^\| shard download +\|.*\| +([\d.]+) \|$", 100.0),)),
    Bench("market", "Coverage market: convergence and gossip bandwidth (real daemons)",
          ("bench_market.py", "--nodes", "5", "10", "20"),
          ("bench_market.py", "--nodes", "5", "10", "--steady-s", "20"),
          "every unit at target replicas; bandwidth per node reported"),
    Bench("market-sim", "Coverage market at internet scale (simulation)",
          ("sim_market.py", "sim"), ("sim_market.py", "sim", "--nodes", "250", "1000"),
          "full coverage at 1,000 and 10,000 nodes; what breaks first"),
    Bench("settlement", "Settlement latency and claims", ("bench_settlement.py", "--n", "100"),
          ("bench_settlement.py", "--n", "30"), "quote -> pay -> verify well under a second",
          (Check("quote -> pay -> verified, median ms",
                 r"^quote→pay→verified \(total\) +([\d.]+)", most=1000.0),)),
    Bench("money", "Paid requests through real daemons: settlement cost, receipts, claims",
          ("bench_money.py", "--rounds", "10"), ("bench_money.py", "--rounds", "4"),
          "being paid adds nothing measurable to a decode step; receipts off the token path"),
    Bench("metering", "The serving peers' meter: a metered ring against an unmetered one",
          ("bench_metering.py", "--pairs", "12"), ("bench_metering.py", "--pairs", "6"),
          "metering costs <= 3 % of decode tok/s (paired)",
          (Check("metered / unmetered decode", r"^A / B per pair \(median\) +([\d.]+) x", 0.97),)),
    Bench("spotcheck", "Spot checks of ring stages: generations at rates 0, 0.1 (default), 1",
          ("bench_spotcheck.py",), ("bench_spotcheck.py", "--rounds", "2"),
          "the default rate's cost stated; nothing honest flagged"),
    Bench("relay", "Relayed vs direct RTT and throughput", ("bench_relay.py",),
          ("bench_relay.py",), "relayed path usable for latency-tolerant work"),
    Bench("cli", "Command-line start-up: --version, status, peers",
          ("bench_cli.py", "--runs", "15"), ("bench_cli.py", "--runs", "5"),
          "under 0.3 s for --version, status and peers",
          (Check("median s", r"^\S+ +([\d.]+) +[\d.]+ +(?:yes|no)$", most=0.3),)),
    Bench("replay", "Exact failover replay: one position at a time against one batch",
          ("bench_replay.py", "--rounds", "5"), ("bench_replay.py", "--rounds", "2"),
          "a failover continues with the bits of an undisturbed run; cost per replayed token",
          (Check("replayed one at a time, exact",
                 r"^ *\d+ +[\d.]+ +[\d.]+ +[\d.]+ +\S+ +(True|False)$", equals="True"),)),
    Bench("proofs", "Checking a peer's claim to hold units",
          ("bench_proofs.py", "--rounds", "30"), ("bench_proofs.py", "--rounds", "10"),
          "a claim is checked before routing trusts it, in a few milliseconds",
          (Check("verdict", r"^holds .{8,} +(\S+) +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$",
                 equals="proven"),)),
    Bench("grammar", "Decode with a JSON-schema constraint",
          ("bench_grammar.py", "--rounds", "11"), ("bench_grammar.py", "--rounds", "3"),
          "constrained decoding at >= 0.9x unconstrained tokens/s",
          (Check("constrained / unconstrained",
                 r"^ratio constrained/unconstrained, median of rounds: ([\d.]+)", 0.9),)),
    Bench("fuzz", "A node under fuzz from foreign peers", ("fuzz_peer.py", "--seconds", "60"),
          ("fuzz_peer.py", "--seconds", "20"),
          "the node stays up and answers every request while fuzzed",
          (Check("node alive", r"^node alive: (\S+);", equals="True"),
           Check("kept its honest peer", r"still has its honest peer: (\S+)$", equals="True"))),
    Bench("soak", "Churn soak: kills, restarts and a slowed node under four clients",
          ("soak.py", "--seconds", "300"), ("soak.py", "--seconds", "90"),
          ">= 99 % of requests complete, every greedy output the undisturbed one",
          (Check("requests completed, %", r"^\| \d+ \| \d+ \(([\d.]+) %\)", 99.0),),
          timeout_s=1200.0),
)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) // 1024 // 1024 for line in open("/proc/meminfo")
                if line.startswith("MemTotal")), 0)
    return (f"{cpu}, {os.cpu_count()} cores, {mem} GiB RAM, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}")


def commit() -> str:
    """This checkout's commit, so that a stored result says which code it measured."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    changed = git("diff", "--quiet", "HEAD", "--", "kvasird", "kvasird_dev").returncode != 0
    return f"{head} with uncommitted changes to the package" if changed else head


def judge(bench: Bench, output: str) -> tuple[str, str]:
    """The verdict of a run that exited cleanly, and what it rests on."""
    if not bench.checks:
        return "unjudged", "the target is not a number: read the table"
    held = {check.label: check.held(output) for check in bench.checks}
    said = [(text, ok) for found in held.values() if found for text, ok in found]
    if not all(ok for _, ok in said):
        return "not met", "; ".join(text for text, ok in said if not ok)
    absent = [label for label, found in held.items() if found is None]
    if absent:
        return "unjudged", f"not in the output: {', '.join(absent)}"
    return "met", "; ".join(dict.fromkeys(text for text, _ in said))


def execute(command: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """Exit status (None when it ran past ``timeout_s``), stdout and stderr of ``command``.
    It runs in its own process group, so that the daemons a benchmark starts go down with it
    when it is stopped, and imports this checkout's package, as do the daemons it starts
    (not whichever one the environment installed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return None, out, err


def run(bench: Bench, quick: bool, timeout_s: float | None, scripts: Path = BENCH) -> Result:
    """Run one benchmark (its script in ``scripts``) and judge its output against its
    target."""
    args = bench.quick if quick else bench.args
    bound = min(bench.timeout_s, timeout_s or math.inf)
    command = f".venv/bin/python bench/{shlex.join(args)}"
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    if not (scripts / args[0]).exists():
        return Result(bench.name, command, quick, machine(), commit(), started, 0.0, "missing",
                      f"bench/{args[0]} does not exist", "")
    began = time.monotonic()
    code, out, err = execute([sys.executable, str(scripts / args[0]), *args[1:]], bound)
    seconds = time.monotonic() - began
    if code is None:
        verdict, why = "timed out", (f"stopped after {bound:.0f} s; the end of its stderr "
                                     "after its output up to then")
    elif code != 0:
        verdict, why = "failed", f"exit {code}; the end of its stderr after its output"
    else:
        verdict, why = judge(bench, out)
    if code != 0:
        out = f"{out.rstrip()}\n\n{err[-3000:]}"
    return Result(bench.name, command, quick, machine(), commit(), started, round(seconds, 1),
                  verdict, why, out.strip())


def store(result: Result, results: Path = RESULTS) -> None:
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{result.name}.json"
    path.write_text(json.dumps(asdict(result), indent=1, ensure_ascii=False) + "\n")


def stored(results: Path = RESULTS) -> dict[str, Result]:
    """The latest result of every benchmark that has one, by name."""
    return {path.stem: Result(**json.loads(path.read_text()))
            for path in sorted(results.glob("*.json"))}


def render(benches: Iterable[Bench], results: dict[str, Result]) -> str:
    """The report: a summary row and a section per benchmark, both from ``results``."""
    benches = list(benches)
    rows = ["| benchmark | verdict | run (UTC) | seconds | target |", "|---|---|---|---|---|"]
    sections = []
    for bench in benches:
        result = results.get(bench.name)
        if result is None:
            rows.append(f"| {bench.name} | not run | | | {bench.target} |")
            sections.append(f"## {bench.title}\n\nTarget: {bench.target}.  \nVerdict: not run "
                            f"(no stored result: `.venv/bin/python bench/run_all.py --only "
                            f"{bench.name}`).\n")
            continue
        quick = " (quick)" if result.quick else ""
        rows.append(f"| {bench.name} | {result.verdict} | {result.started}{quick} "
                    f"| {result.seconds:.0f} | {bench.target} |")
        sections.append(f"## {bench.title}\n\nTarget: {bench.target}.  \n"
                        f"Verdict: {result.verdict} ({result.why}).  \n"
                        f"Run: {result.started} UTC{quick}, {result.seconds:.0f} s, "
                        f"`{result.command}` at "
                        f"{result.commit}, on {result.machine}.\n\n"
                        f"```text\n{result.output}\n```\n")
    return ("# kvasird benchmark report\n\nThe latest run of each benchmark, rebuilt by "
            "`bench/run_all.py` from `bench/results/`; earlier runs are in git's history. "
            "Verdicts: " + ", ".join(f'"{v}"' for v in VERDICTS) + ".\n\n"
            + "\n".join(rows) + "\n\n" + "\n".join(sections))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="cheaper settings for each")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHES],
                        help="rerun these; the report keeps the others' stored results")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="bound every benchmark's run to this (a shared machine's turn)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild the report from the stored results")
    parser.add_argument("--out", type=Path, default=BENCH / "REPORT.md")
    args = parser.parse_args()
    for bench in BENCHES:
        if args.report_only or (args.only and bench.name not in args.only):
            continue
        print(f"[run_all] {bench.name} ...", file=sys.stderr, flush=True)
        result = run(bench, args.quick, args.timeout_s)
        store(result)
        args.out.write_text(render(BENCHES, stored()))
        print(f"[run_all] {bench.name}: {result.verdict} ({result.why}), {result.seconds:.0f} s",
              file=sys.stderr, flush=True)
    args.out.write_text(render(BENCHES, stored()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
