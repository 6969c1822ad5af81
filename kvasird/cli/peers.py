"""``kvasird peers``: the peers the running daemon is connected to."""

from __future__ import annotations

import argparse
import json
import time

from kvasird.admin import client
from kvasird.cli import home_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peers", help="connected peers")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    peers = client.get(home_of(args), "/v0/peers")
    if args.json:
        print(json.dumps(peers, indent=2))
        return 0
    if not peers:
        print("no peers (yet): check `kvasird bootstrap list`")
        return 0
    now = time.time()
    print(f"{'peer id':54} {'connected':>10} {'last seen':>10} {'rtt':>8}  address")
    for p in peers:
        rtt = f"{p['rtt_ms']:.1f}ms" if p["rtt_ms"] is not None else "-"
        addr = p["addrs"][0] if p["addrs"] else "-"
        print(
            f"{p['peer_id']:54} {now - p['connected_since']:>9.0f}s "
            f"{now - p['last_seen']:>9.1f}s {rtt:>8}  {addr}"
        )
    return 0
