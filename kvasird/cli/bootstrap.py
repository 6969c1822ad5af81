"""``kvasird bootstrap list|add|rm``: edit the bootstrap list in kvasird.toml.

``add`` also has a running daemon dial the peer at once and keep it connected (like
kubo's ``swarm connect``), and says whether the dial worked; ``rm`` applies at restart.
"""

from __future__ import annotations

import argparse

from kvasird.admin import client
from kvasird.cli import home_of
from kvasird.config import load, load_text, render
from kvasird.errors import DaemonNotRunning
from kvasird.home import Home


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bootstrap", help="list or edit the peers this node joins through")
    cmds = p.add_subparsers(dest="bootstrap_command", metavar="ACTION", required=True)
    cmds.add_parser("list", help="print the bootstrap list").set_defaults(func=_list)
    add = cmds.add_parser("add", help="add a peer (multiaddr ending in /p2p/<peer id>)")
    add.add_argument("addrs", nargs="+", metavar="MULTIADDR")
    add.set_defaults(func=_add)
    rm = cmds.add_parser("rm", help="remove a peer (its multiaddr, or just its peer id)")
    rm.add_argument("addrs", nargs="+", metavar="MULTIADDR_OR_PEER_ID")
    rm.set_defaults(func=_rm)


def _list(args: argparse.Namespace) -> int:
    for addr in load(home_of(args).config).p2p.bootstrap:
        print(addr)
    return 0


DIAL_WAIT_S = 30.0
"""How long `bootstrap add` waits for the daemon's dial (which itself gives up sooner)."""


def _add(args: argparse.Namespace) -> int:
    home = home_of(args)
    current = list(load(home.config).p2p.bootstrap)
    _save(home, current + [a for a in args.addrs if a not in current])
    try:
        dials = [client.post(home, "/v0/bootstrap", DIAL_WAIT_S, {"addr": a}) for a in args.addrs]
    except DaemonNotRunning:
        print("the daemon is not running: it dials the list when it starts")
        return 0
    for addr, dial in zip(args.addrs, dials, strict=True):
        if dial.get("connected"):
            print(f"connected to {dial['peer_id']}")
        else:
            print(
                f"could not connect to {addr}: {dial.get('error')}; the daemon keeps "
                "trying, with backoff"
            )
    return 0 if all(d.get("connected") for d in dials) else 1


def _rm(args: argparse.Namespace) -> int:
    home = home_of(args)
    current = list(load(home.config).p2p.bootstrap)
    keep = [
        a for a in current if a not in args.addrs and a.rsplit("/p2p/", 1)[-1] not in args.addrs
    ]
    if len(keep) == len(current):
        print("nothing removed: no bootstrap entry matches")
        return 1
    _save(home, keep)
    return 0


def _save(home: Home, addrs: list[str]) -> None:
    text = render(home.config.read_text(), {"p2p.bootstrap": addrs})
    load_text(text, source=str(home.config))  # validate before writing
    home.config.write_text(text)
    print(
        f"bootstrap list now has {len(addrs)} entr{'y' if len(addrs) == 1 else 'ies'} "
        f"in {home.config}"
    )
