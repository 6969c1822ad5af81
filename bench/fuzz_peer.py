"""Fuzz a serving node from two foreign peers for a minute; print what was sent and served.

    .venv/bin/python bench/fuzz_peer.py [--seconds 60]

A node holding the whole bundled model (and one honest peer) on 127.0.0.1; one foreign
py-libp2p peer that answers the heartbeat and one that never does send it garbage,
oversized, truncated, slow and half-closed input on every protocol, gossip topic and the
lane port (tests/integration/fuzz_peer.py), while a client runs generations back to back
through the node's admin API. Prints messages per (protocol, kind), the generations'
success rate and whether the node stayed up and kept its honest peer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from fuzz_peer import FuzzPeer, generate_ok, start_target  # noqa: E402

from kvasird.localnet import LocalNet  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalNet(Path(tmp), 2) as net:
        target = start_target(net)
        lane = target.get("/v0/inference")["lanes"]["port"]
        served: Counter[str] = Counter()
        latencies: list[float] = []
        done = threading.Event()

        def client() -> None:
            while not done.is_set():
                began = time.monotonic()
                ok = generate_ok(target)
                served["ok" if ok else "failed"] += 1
                if ok:
                    latencies.append(time.monotonic() - began)

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        counts: Counter[tuple[str, str]] = Counter()
        redials = 0

        async def attack() -> None:
            nonlocal redials
            peers = [FuzzPeer("localnet", answer_liveness=a, seed=i)
                     for i, a in enumerate((True, False))]

            async def one(peer: FuzzPeer) -> None:
                counts.update(await peer.run(target.join_addr, target.peer_id, lane,
                                             args.seconds))

            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(one, peer)
            redials = sum(p.redials for p in peers)

        trio.run(attack)
        done.set()
        thread.join(60)
        alive = target.alive()
        honest = net.nodes[1].peer_id in target.peer_ids() if alive else False

    print(f"{'protocol or topic':<24} {'kind':<12} {'sent':>6}")
    for (proto, kind), n in sorted(counts.items()):
        print(f"{proto:<24} {kind:<12} {n:>6}")
    total = served["ok"] + served["failed"]
    lat = sorted(latencies)
    print(f"\n{sum(counts.values())} messages in {args.seconds:g} s; the silent peer dialled "
          f"{redials} times after being dropped")
    print(f"generations meanwhile: {served['ok']} of {total} ok "
          f"({100 * served['ok'] / max(total, 1):.1f} %), median "
          f"{lat[len(lat) // 2] * 1000 if lat else 0:.0f} ms")
    print(f"node alive: {alive}; still has its honest peer: {honest}")
    return 0 if alive and honest and served["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
