"""Relayed vs direct: round-trip time and bulk throughput to the same peer.

    .venv/bin/python bench/bench_relay.py [--rounds 200] [--mib 32]

Three processes on 127.0.0.1, each with the daemon's own p2p code:

    relay R    a P2PNode offering circuit relay v2 (relay_service = "on")
    target C   a P2PNode that announces a dead port, so its dial-back check finds it
               private and it reserves on R; it serves an echo/sink bench protocol
    client A   this process: a P2PNode that reaches C first directly at its real listen
               address, then through R (the dialer's circuit path, as the daemon dials),
               and measures the same things both times

Rows: connect (dial to a usable connection), 6 KB echo RTT median and p99 over
--rounds requests on one stream, and --mib MiB written on one stream and acknowledged.
A relayed byte crosses two Noise+yamux connections and R's Python copy loop, so both
latency and throughput pay roughly twice the per-hop cost, plus R's scheduling.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from kvasird.config import P2PConfig
from kvasird.identity.nodekey import create_node_key
from kvasird.localnet.launcher import free_port
from kvasird.logs import configure
from kvasird.p2p import P2PNode
from kvasird.wire import read_frame, write_frame

PROTOCOL = "/kvasir/bench-relay/1"
ECHO_BYTES = 6 * 1024
CHUNK = 256 * 1024
ATTEMPTS = 3
FAST = dict(heartbeat_interval_s=1.0, liveness_timeout_s=10.0, mdns=False, dht=False,
            peer_exchange=False)


# --- the two helper processes ------------------------------------------------------------

async def _serve_bench(stream: INetStream) -> None:
    """Echo frames; a {"sink": n} frame is followed by n raw bytes, then acknowledged."""
    try:
        while True:
            msg = await read_frame(stream, 1 << 20)
            if isinstance(msg, dict) and "sink" in msg:
                left = int(msg["sink"])
                while left > 0:
                    data = await stream.read(min(left, 1 << 20))
                    if not data:
                        return
                    left -= len(data)
                await write_frame(stream, {"ok": True})
            else:
                await write_frame(stream, msg)
    except Exception:  # noqa: BLE001 - the client closed the stream
        return


async def _helper(role: str, work: Path, relay_addr: str) -> None:
    port = free_port()
    if role == "relay":
        config = P2PConfig(listen=(f"/ip4/127.0.0.1/tcp/{port}",), relay_service="on", **FAST)
    else:
        config = P2PConfig(listen=(f"/ip4/127.0.0.1/tcp/{port}",), bootstrap=(relay_addr,),
                           announce=(f"/ip4/127.0.0.1/tcp/{free_port()}",),
                           relay_reservations=1, reachability_interval_s=30.0, **FAST)
    node = P2PNode(create_node_key(work / f"{role}.key"), config, "bench",
                   sqlite3.connect(":memory:"))
    node.host.set_stream_handler(PROTOCOL, _serve_bench)
    async with node.running():
        if role == "target":
            with trio.fail_after(60):
                while not node.relays.reservations:  # noqa: ASYNC110 - polled state
                    await trio.sleep(0.2)
        real = f"/ip4/127.0.0.1/tcp/{port}/p2p/{node.peer_id}"
        print(json.dumps({"direct": real, "circuit": node.relays.circuit_addrs()}), flush=True)
        await trio.sleep_forever()


def _start(role: str, work: Path, relay_addr: str = "") -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen([sys.executable, __file__, "--helper", role, str(work), relay_addr],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the {role} process did not start")
    return proc, json.loads(line)


# --- the client ---------------------------------------------------------------------------

async def _measure(host, target: ID, rounds: int, mib: int) -> dict[str, float]:  # noqa: ANN001
    stream = await host.new_stream(target, [PROTOCOL])
    payload = {"b": b"x" * ECHO_BYTES}
    rtts = []
    for _ in range(rounds):
        start = time.perf_counter()
        await write_frame(stream, payload)
        await read_frame(stream, 1 << 20)
        rtts.append((time.perf_counter() - start) * 1000)
    total = mib << 20
    chunk = b"y" * CHUNK
    start = time.perf_counter()
    await write_frame(stream, {"sink": total})
    for _ in range(total // CHUNK):
        await stream.write(chunk)
    await read_frame(stream, 1024)
    seconds = time.perf_counter() - start
    await stream.close()
    rtts.sort()
    return {"rtt_ms": statistics.median(rtts), "p99_ms": rtts[int(len(rtts) * 0.99) - 1],
            "mb_s": total / seconds / 1e6}


async def _client(work: Path, relay: dict, target: dict, rounds: int, mib: int) -> list[tuple]:
    config = P2PConfig(listen=(f"/ip4/127.0.0.1/tcp/{free_port()}",), relay_service="off",
                       relay_reservations=0, **FAST)
    node = P2PNode(create_node_key(work / "client.key"), config, "bench",
                   sqlite3.connect(":memory:"))
    target_id = ID.from_base58(target["direct"].rsplit("/p2p/", 1)[1])
    rows = []
    async with node.running():
        start = time.perf_counter()
        if not await node.dialer.dial([target["direct"]]):
            raise SystemExit("the direct dial failed")
        connect_ms = (time.perf_counter() - start) * 1000
        rows.append(("direct", connect_ms, await _measure(node.host, target_id, rounds, mib)))
        await node.host.get_network().close_peer(target_id)
        with trio.fail_after(10):
            while node.dialer.connected(target_id.to_string()):  # noqa: ASYNC110 - polled state
                await trio.sleep(0.1)
        if not await node.dialer.dial([relay["direct"]]):
            raise SystemExit("cannot reach the relay")
        for attempt in range(1, ATTEMPTS + 1):
            start = time.perf_counter()
            if not await node.dialer.dial(target["circuit"]):
                raise SystemExit("the relayed dial failed")
            connect_ms = (time.perf_counter() - start) * 1000
            try:
                relayed = await _measure(node.host, target_id, rounds, mib)
            except Exception as exc:  # noqa: BLE001 - py-libp2p's relay drops some circuits
                print(f"relayed attempt {attempt}: circuit dropped mid-run ({exc!r})",
                      file=sys.stderr)
                await node.host.get_network().close_peer(target_id)
                await trio.sleep(1)
                continue
            rows.append((f"relayed via R (attempt {attempt})", connect_ms, relayed))
            break
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--helper", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure("warning", json=False)
    if args.helper:
        role, work, relay_addr = args.helper
        trio.run(_helper, role, Path(work), relay_addr)
        return
    with tempfile.TemporaryDirectory(prefix="bench-relay-") as tmp:
        work = Path(tmp)
        procs = []
        try:
            relay_proc, relay = _start("relay", work)
            procs.append(relay_proc)
            target_proc, target = _start("target", work, relay["direct"])
            procs.append(target_proc)
            rows = trio.run(_client, work, relay, target, args.rounds, args.mib)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    print(f"\n3 processes on 127.0.0.1 (TCP + Noise + yamux), {args.rounds} x 6 KB echoes, "
          f"{args.mib} MiB bulk on one stream\n")
    print("| path | connect ms | RTT median ms | RTT p99 ms | bulk MB/s |")
    print("|---|---|---|---|---|")
    for name, connect_ms, m in rows:
        print(f"| {name} | {connect_ms:.1f} | {m['rtt_ms']:.2f} | {m['p99_ms']:.2f} | "
              f"{m['mb_s']:.1f} |")


if __name__ == "__main__":
    main()
