"""The daemon's own costs: start-up to "ready", idle RSS and CPU, alone and with peers.

    .venv/bin/python bench/bench_daemon.py [--peers 3] [--idle-s 30]

Real `kvasird run` processes on 127.0.0.1 (the same launcher as the tests), no model.
Prints one table; medians where there are several samples.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from kvasird.localnet import LocalNet

QUIET = {"gateway.enabled": False}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def idle(net: LocalNet, seconds: float) -> tuple[float, float]:
    """(median RSS MB, median CPU %) of the nodes over ``seconds`` of idling."""
    pids = [n.proc.pid for n in net.nodes if n.proc]
    before = {p: cpu_seconds(p) for p in pids}
    start = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - start
    cpu = [100 * (cpu_seconds(p) - before[p]) / wall for p in pids]
    return statistics.median(rss_mb(p) for p in pids), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--starts", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        with LocalNet(Path(tmp) / "one", 1, settings=QUIET) as net:
            net.configure(net.nodes[0], [])
            starts = []
            for _ in range(args.starts):
                began = time.monotonic()
                net.nodes[0].start()
                starts.append(time.monotonic() - began)
                net.nodes[0].stop()
            net.nodes[0].start()
            rss, cpu = idle(net, args.idle_s)
            rows.append(("1 daemon, no peers", statistics.median(starts), rss, cpu))
        with LocalNet(Path(tmp) / "many", args.peers, settings=QUIET) as net:
            began = time.monotonic()
            net.up()
            net.wait_until("all connected", net.fully_connected, timeout=60)
            joined = time.monotonic() - began
            rss, cpu = idle(net, args.idle_s)
            rows.append((f"{args.peers} daemons, all connected (heartbeat 1 s)", joined, rss, cpu))
    print(f"{'setup':44} {'to ready/joined s':>17} {'RSS MB':>8} {'idle CPU %':>10}")
    for name, t, rss, cpu in rows:
        print(f"{name:44} {t:>17.2f} {rss:>8.1f} {cpu:>10.2f}")


if __name__ == "__main__":
    main()
