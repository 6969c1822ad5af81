"""``kvasird id``: this node's peer id (and join addresses when it runs)."""

from __future__ import annotations

import argparse

from kvasird.admin import client
from kvasird.cli import home_of
from kvasird.errors import DaemonNotRunning
from kvasird.identity import load_node_key


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("id", help="print this node's peer id and join addresses")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    home = home_of(args)
    home.require_initialised()
    print(load_node_key(home.node_key).peer_id.to_string())
    try:
        for addr in client.get(home, "/v0/status")["listen_addrs"]:
            print(addr)
    except DaemonNotRunning:
        pass
    return 0
