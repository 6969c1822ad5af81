"""``kvasird init``: create the state directory, node key and config."""

from __future__ import annotations

import argparse
from typing import Any

from kvasird.cli import home_of
from kvasird.config import default_text, load_text, render
from kvasird.db import connect
from kvasird.errors import HomeError
from kvasird.home import Home
from kvasird.identity import create_node_key


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="create the state directory, node key and config")
    p.add_argument("--network", default=None, help="network name to join (default: kvasir-local)")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="peer to join through, ending in /p2p/<peer id> (repeatable)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    home = home_of(args)
    values: dict[str, Any] = {"p2p.bootstrap": args.bootstrap}
    if args.network:
        values["node.network"] = args.network
    key = init_home(home, values)
    print(f"initialised {home.root}")
    print(f"peer id      {key}")
    print(f"config       {home.config}")
    print(f"start it with: kvasird --home {home.root} run")
    return 0


def init_home(home: Home, values: dict[str, Any]) -> str:
    """Create ``home`` with a new key and a config with ``values`` set; return the peer id.

    The config is validated before anything is written, so a bad --bootstrap leaves no
    half-made home behind. An existing key is never replaced.
    """
    text = render(default_text(), values)
    load_text(text, source="the new kvasird.toml")
    if home.node_key.exists():
        raise HomeError(f"{home.root} is already initialised (node key {home.node_key} exists); "
                        "refusing to overwrite it. Use another --home for a second node.")
    home.root.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = create_node_key(home.node_key)
    if not home.config.exists():
        home.config.write_text(text)
    connect(home.db, create=True).close()  # a home being made may start from an empty file
    return key.peer_id.to_string()
