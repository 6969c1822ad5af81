"""``kvasird run``: run the daemon in the foreground (systemd runs it the same way)."""

from __future__ import annotations

import argparse

import trio

from kvasird import logs
from kvasird.cli import home_of
from kvasird.config import load
from kvasird.daemon.node import Node, run_until_signal


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the daemon in the foreground")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    """Run with the home's lock held, taken before anything opens the database."""
    home = home_of(args)
    home.require_initialised()
    with home.exclusive():
        config = load(home.config)
        logs.configure(config.node.log_level)
        node = Node(home, config)
        trio.run(run_until_signal, node)
    return 0
