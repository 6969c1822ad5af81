"""A churn soak across real daemons; prints completion, equality, latency and stalls.

    .venv/bin/python bench/soak.py [--seconds 300] [--kill-every 40] [--clients 4]

Four daemons of the bundled model with two replicas of every layer (kvasird_dev.soak):
every --kill-every seconds one of the three serving nodes is SIGKILLed and started again,
and for a minute one of them is slowed (SIGSTOP/SIGCONT at a 50 % duty cycle), while
--clients clients run greedy generations back to back through the gateway and never
retry. Every completed output is compared with one undisturbed daemon's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvasird.model.bundled import bundled_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvasird_dev (not installed)
from kvasird_dev.soak import Soak  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--kill-every", type=float, default=40.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Soak(Path(tmp), bundled_path(), duration_s=args.seconds,
                      kill_every_s=args.kill_every, clients=args.clients,
                      degrade_at_s=min(20.0, args.seconds / 4), degrade_s=60.0,
                      n_tokens=args.tokens).run()
    s = report.summary()
    print("| requests | completed | equal to undisturbed | kills | latency p50 | latency p99 "
          "| stall at a kill, p50 | stall max |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {s['requests']} | {s['completed']} ({s['completed_pct']:.1f} %) | {s['equal']} "
          f"| {s['kills']} | {s['latency_p50_s']:.2f} s | {s['latency_p99_s']:.2f} s "
          f"| {s['stall_p50_s']:.2f} s | {s['stall_max_s']:.2f} s |")
    for line in report.log:
        print(f"- {line}")
    for error, n in sorted(s["errors"].items(), key=lambda kv: -kv[1]):
        print(f"- {n} x {error}")
    return 0 if s["completed"] == s["requests"] and s["equal"] == s["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
