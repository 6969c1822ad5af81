"""How fast the command line answers: `--version`, `status` and `peers`.

    .venv/bin/python bench/bench_cli.py [--runs 20] [--before PATH]

Each command runs as a fresh `python -m kvasird` process, as a user's shell would start
it; `status` and `peers` ask a real single daemon on 127.0.0.1 (started here in a
temporary home, with this checkout, and stopped after). ``--before PATH`` also runs the
same commands from another checkout of the package (PYTHONPATH=PATH) against the same
daemon, interleaved with this one's runs so both see the same machine load. Prints one
table of medians (and the fastest run) in seconds; target: under 0.3 s each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvasird.localnet import LocalNet

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 0.3


def command_lines(home: Path) -> dict[str, list[str]]:
    """The commands timed; --home goes first, where every version of the CLI accepts it."""
    return {"--version": ["--version"],
            "status": ["--home", str(home), "status"],
            "peers": ["--home", str(home), "peers"]}


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def imported_from(env: dict[str, str]) -> str:
    """Where the kvasird package that ``env`` runs comes from (to show which tree ran)."""
    done = subprocess.run([sys.executable, "-c", "import kvasird; print(kvasird.__file__)"],
                          env=env, capture_output=True, text=True, check=True, cwd="/")
    return str(Path(done.stdout.strip()).parent.parent)


def time_once(args: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvasird", *args], env=env, cwd="/",
                          capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"kvasird {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return took


def measure(commands: dict[str, list[str]], trees: dict[str, dict[str, str]],
            runs: int) -> dict[tuple[str, str], list[float]]:
    """Seconds of every run, by (command, tree); one untimed warm-up run each first."""
    times: dict[tuple[str, str], list[float]] = {}
    for name, args in commands.items():
        for env in trees.values():
            time_once(args, env)
        for _ in range(runs):
            for tree, env in trees.items():
                times.setdefault((name, tree), []).append(time_once(args, env))
    return times


def print_table(times: dict[tuple[str, str], list[float]], commands: list[str],
                trees: list[str]) -> None:
    head = f"{'command':12}" + "".join(f" {t + ' median':>14} {t + ' min':>11}" for t in trees)
    if len(trees) == 2:
        head += f" {'speed-up':>9}"
    print(head + f" {'< ' + str(TARGET_S) + ' s':>8}")
    for name in commands:
        medians = [statistics.median(times[(name, t)]) for t in trees]
        row = f"{name:12}" + "".join(f" {m:>14.3f} {min(times[(name, t)]):>11.3f}"
                                     for m, t in zip(medians, trees, strict=True))
        if len(trees) == 2:
            row += f" {medians[0] / medians[1]:>8.1f}x"
        print(row + f" {'yes' if medians[-1] < TARGET_S else 'no':>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="timed runs per command and tree")
    ap.add_argument("--before", type=Path, default=None,
                    help="another checkout's root, run side by side (PYTHONPATH=PATH)")
    args = ap.parse_args()
    trees = {"after": tree_env(ROOT)}
    if args.before is not None:
        trees = {"before": tree_env(args.before.resolve()), **trees}
    for tree, env in trees.items():
        print(f"{tree}: kvasird from {imported_from(env)}")
    with tempfile.TemporaryDirectory() as tmp, \
            LocalNet(Path(tmp) / "net", 1, settings={"gateway.enabled": False}) as net:
        net.up()
        commands = command_lines(net.nodes[0].home.root)
        times = measure(commands, trees, args.runs)
    print(f"{args.runs} runs each, seconds (python -m kvasird, a fresh process per run)")
    print_table(times, list(commands), list(trees))


if __name__ == "__main__":
    main()
