"""The ``kvasird`` command line: one module per subcommand.

Each module in COMMANDS has ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` on it. ``main`` turns every KvasirError into one line on stderr
and exit status 1: the message already says what to do.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from kvasird import __version__
from kvasird.errors import first_kvasir_error
from kvasird.home import Home, default_home

COMMANDS = (
    "init",
    "run",
    "id",
    "status",
    "peers",
    "bootstrap",
    "native",
    "localnet",
    "coverage",
    "service",
    "dev",
    "verify",
    "model",
    "localchain",
    "wallet",
    "chat",
    "generate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvasird", description="Kvasir node daemon")
    parser.add_argument("--version", action="version", version=f"kvasird {__version__}")
    parser.add_argument("--home", type=Path, default=None,
                        help="state directory (default: $KVASIRD_HOME, else ~/.kvasird)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"kvasird.cli.{name}").register(sub)
    return parser


def home_of(args: argparse.Namespace) -> Home:
    return Home((args.home or default_home()).expanduser().resolve())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # noqa: BLE001 - KvasirErrors may arrive inside exception groups
        found = first_kvasir_error(exc)
        if found is None:
            raise
        print(f"kvasird: {found}", file=sys.stderr)
        return 1
