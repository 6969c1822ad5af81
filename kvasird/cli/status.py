"""``kvasird status``: what the running daemon is doing."""

from __future__ import annotations

import argparse
import json

from kvasird.admin import client
from kvasird.cli import home_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="status of the running daemon")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    status = client.get(home_of(args), "/v0/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"peer id      {status['peer_id']}")
    print(f"network      {status['network']}")
    print(f"version      kvasird {status['version']} (protocol {status['protocol']})")
    print(f"uptime       {status['uptime_s']:.0f} s")
    print(f"peers        {status['peers']}")
    if (earned := status.get("earnings")) is not None:
        from kvasird.settlement.token import format_kvr  # deferred: loads solders and spl

        print(f"earnings     {format_kvr(earned['earned'])} KVR from {earned['gateways']} "
              f"gateway(s), {format_kvr(earned['received'])} received, "
              f"{format_kvr(earned['pending'])} pending (`kvasird wallet claim`)")
    reach = status.get("reachability") or {}
    if reach:
        print(f"reachability {reach.get('verdict', 'unknown')}")
    for addr in status["listen_addrs"]:
        print(f"listening    {addr}")
    return 0
