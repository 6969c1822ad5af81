"""The ``kvasird`` command line: one module per subcommand.

Each module named in COMMANDS has ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` on it. Only the module of the command being run is imported (the
others stay stubs that only list themselves in ``--help``), so ``--version``, ``status``
and ``peers`` answer without loading libp2p, numpy or the chain client. ``--home`` is
accepted before or after the subcommand. ``main`` turns every KvasirError into one line
on stderr and exit status 1: the message already says what to do. Output cut short by its
reader (``kvasird wallet | head -3``) ends the command quietly, as it would a C program.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvasird import __version__

if TYPE_CHECKING:
    from kvasird.home import Home

COMMANDS = {
    "init": "create the state directory, node key and config",
    "run": "run the daemon in the foreground",
    "id": "print this node's peer id and join addresses",
    "status": "status of the running daemon",
    "peers": "connected peers",
    "bootstrap": "list or edit the peers this node joins through",
    "native": "the native (ggml) runtime",
    "localnet": "run a local network of daemons on 127.0.0.1",
    "coverage": "who holds which units of the model, and what is scarce",
    "service": "install kvasird as a systemd service",
    "verify": "check the compute engine against the float64 oracle",
    "model": "models and shards held by this node",
    "localchain": "run a local Solana chain (LiteSVM) with a KVR mint and faucet",
    "wallet": "operator wallet: address, SOL/KVR balances, pending earnings",
    "chat": "chat with a model through a gateway (streaming)",
    "generate": "generate text through the swarm from this node",
    "pay": "ask a gateway one question and pay for it in KVR",
}
"""Every subcommand and its line in ``kvasird --help``."""

CREATES_HOME = frozenset({"init", "model add", "localchain"})
"""The commands that may create a missing home; every other one refuses to run on it, so
a mistyped --home is reported instead of appearing as a new directory."""

HOME_HELP = (
    "state directory (default: $KVASIRD_HOME, else ~/.kvasird, else the service's /var/lib/kvasird)"
)
BROKEN_PIPE_STATUS = 141
"""Exit status when stdout's reader went away: a shell's status for a process killed by
SIGPIPE (128 + 13), which Python ignores and reports as BrokenPipeError instead."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with ``command``'s module registered in full and the others as stubs."""
    parser = argparse.ArgumentParser(
        prog="kvasird", description="Kvasir node daemon", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"kvasird {__version__}")
    parser.add_argument("--home", type=Path, default=None, help=HOME_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in COMMANDS.items():
        if name == command:
            importlib.import_module(f"kvasird.cli.{name}").register(sub)
            _accept_home(sub.choices[name])
        else:
            sub.add_parser(name, help=text)
    return parser


def _accept_home(parser: argparse.ArgumentParser) -> None:
    """Add --home to ``parser`` and every parser under it; absent, it leaves the value given
    before the subcommand (or none) in place."""
    parser.add_argument("--home", type=Path, default=argparse.SUPPRESS, help=HOME_HELP)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _accept_home(child)


def command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not a top-level option."""
    words = iter(argv)
    for word in words:
        if word == "--home":
            next(words, None)
        elif word == "--":
            return next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def command_path(args: argparse.Namespace) -> str:
    """The command as typed, down to its action: "status", "model list", "wallet new"."""
    action = getattr(args, f"{args.command}_command", None)
    return f"{args.command} {action}" if action else str(args.command)


def home_of(args: argparse.Namespace, *, required: bool = True) -> Home:
    """The home the command works on: --home, else $KVASIRD_HOME or ~/.kvasird, else (for a
    command that needs one) the service's (kvasird.home.find_home). Unless the command may
    create one (CREATES_HOME) or the caller can do without (``required=False``), a missing
    home is an error that says how to make one."""
    from kvasird.errors import HomeError
    from kvasird.home import Home, default_home, find_home

    creates = command_path(args) in CREATES_HOME
    if args.home is not None:
        root = args.home
    else:
        root = default_home() if creates or not required else find_home(command_path(args))
    root = root.expanduser().resolve()
    if required and not root.is_dir() and not creates:
        raise HomeError(
            f"there is no kvasird home at {root} (a typo in --home or "
            f"$KVASIRD_HOME?): create one with `kvasird init --home {root}`"
        )
    return Home(root)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _run(argv)
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_STATUS


def _run(argv: list[str]) -> int:
    name = command_in(argv)
    args = build_parser(name if name in COMMANDS else None).parse_args(argv)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader that went away is handled (main)
        return status
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # noqa: BLE001 - KvasirErrors may arrive inside exception groups
        from kvasird.errors import first_kvasir_error

        found = first_kvasir_error(exc)
        if found is None:
            raise
        print(f"kvasird: {found}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the reader that went away
    would raise again when the interpreter flushes it at exit."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (captured): nothing is flushed at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
