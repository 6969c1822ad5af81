"""``kvasird init``: create the state directory, node key and config.

The options set what a second node on the same machine, or a node of a hand-built network,
would otherwise need edited in kvasird.toml: where it listens (``--port-base`` moves every
port at once), the model it serves and how much of it it holds, whom it joins through, and
the chain it settles on (``--rpc-url`` turns settlement on, with a wallet made for the node:
its gateway's vault and its payout address).
``kvasird service install`` takes the same options for the service's first start.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from kvasird.cli import home_of
from kvasird.daemon.init import init_home
from kvasird.errors import ConfigError
from kvasird.settlement.wallet import read_keypair

PORTS = ("p2p", "gateway", "admin", "p2p-ws")
"""What listens at --port-base N, N+1, N+2, N+3."""
SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
"""A size as people write it: 512M, 512MB, 2GiB, 1.5G; a bare number is megabytes."""
WALLET = "wallet.json"
"""The keypair `init --rpc-url` makes, relative to the home."""
SIZE_SHIFT = {"k": -10, "": 0, "m": 0, "g": 10, "t": 20}
"""Each suffix as a power of two relative to MiB (a K, M, G is 1024-based, as [market]
memory_budget_mb counts)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="create the state directory, node key and config")
    add_node_options(p)
    p.set_defaults(func=_run)


def add_node_options(p: argparse.ArgumentParser) -> None:
    """The options that write a new home's kvasird.toml (init, and service install)."""
    p.add_argument("--network", default=None, help="network name to join (default: kvasir-local)")
    p.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="peer to join through, ending in /p2p/<peer id> (repeatable)",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="ADDR",
        help="p2p address to listen on: an IP (0.0.0.0 by default) for the usual "
        "ports, or a full multiaddr such as /ip4/0.0.0.0/tcp/4001 (repeatable)",
    )
    p.add_argument(
        "--port-base",
        type=int,
        default=None,
        metavar="N",
        help="ports N, N+1, N+2, N+3 for p2p, the gateway, the admin API and p2p "
        "over WebSocket: one flag per extra node on a machine",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="MODEL",
        help="the model to serve, in any form [market] model accepts (a GGUF "
        "path, bundled:NAME, a name or a model id)",
    )
    p.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help="memory for the model units this node holds, e.g. 512M or 2GiB",
    )
    p.add_argument(
        "--rpc-url",
        default=None,
        metavar="URL",
        help="settle in KVR on the chain at this Solana JSON-RPC URL (its mint and "
        "genesis wallet are read from a kvasird local chain): turns settlement "
        f"on, with a new wallet {WALLET} in the home",
    )


def node_values(args: argparse.Namespace) -> dict[str, Any]:
    """The kvasird.toml values the node options ask for."""
    from kvasird.model.ref import ModelRef  # deferred: only when a model is given

    values: dict[str, Any] = {"p2p.bootstrap": args.bootstrap}
    if args.network:
        values["node.network"] = args.network
    values.update(_ports(args.listen, args.port_base))
    if args.model is not None:
        ref = ModelRef.parse(args.model, "--model")
        values["market.model"] = ref.value if ref.kind == "path" else args.model
    if args.budget is not None:
        values["market.memory_budget_mb"] = parse_size_mb(args.budget)
    if args.rpc_url is not None:
        values.update(
            {
                "settlement.enabled": True,
                "settlement.rpc_url": args.rpc_url,
                "settlement.wallet": WALLET,
            }
        )
    return values


def node_argv(args: argparse.Namespace) -> list[str]:
    """The node options as given, to hand them on to `kvasird init` elsewhere (the service's
    unit): a model's path made absolute, since that init runs in another directory."""
    model = node_values(args).get("market.model")
    argv = [f"--bootstrap={a}" for a in args.bootstrap] + [f"--listen={a}" for a in args.listen]
    for flag, value in (
        ("--network", args.network),
        ("--port-base", args.port_base),
        ("--model", model),
        ("--budget", args.budget),
        ("--rpc-url", args.rpc_url),
    ):
        if value is not None:
            argv.append(f"{flag}={value}")
    return argv


def _ports(listen: list[str], base: int | None) -> dict[str, Any]:
    """[p2p] listen, and with a port base the gateway's and admin API's ports as well."""
    if base is not None and not 1 <= base <= 65535 - len(PORTS) + 1:
        raise ConfigError(
            f"--port-base {base} is out of range: give a port from 1 to "
            f"{65535 - len(PORTS) + 1} (it takes {len(PORTS)} ports from there)"
        )
    full = [a for a in listen if a.startswith("/")]
    hosts = [a for a in listen if not a.startswith("/")]
    if base is not None and not listen:
        hosts = ["0.0.0.0"]
    p2p, ws = (base, base + 3) if base is not None else (4001, 4002)
    out: dict[str, Any] = {}
    if full or hosts:
        out["p2p.listen"] = full + [
            f"/{_ip_kind(h)}/{h}/tcp/{p}{suffix}"
            for h in hosts
            for p, suffix in ((p2p, ""), (ws, "/ws"))
        ]
    if base is not None:
        out["gateway.listen"] = f"127.0.0.1:{base + 1}"
        out["admin.listen"] = f"127.0.0.1:{base + 2}"
    return out


def _ip_kind(host: str) -> str:
    return "ip6" if ":" in host else "ip4"


def parse_size_mb(text: str) -> int:
    """``text`` (512M, 2GiB, 1.5G, 800) in MiB, for [market] memory_budget_mb."""
    match = SIZE.fullmatch(text.strip())
    if match is None:
        raise ConfigError(f"--budget {text!r} is not a size: write it like 512M, 2GiB or 1.5G")
    number, unit = float(match[1]), match[2].lower()
    return int(number * 2.0 ** SIZE_SHIFT[unit])


def _run(args: argparse.Namespace) -> int:
    home = home_of(args)
    values = node_values(args)
    key = init_home(home, values)
    print(f"initialised {home.root}")
    print(f"peer id      {key}")
    print(f"config       {home.config}")
    if values.get("settlement.wallet"):
        print(
            f"wallet       {read_keypair(home.root / WALLET).pubkey()} ({home.root / WALLET}; "
            "fund it: kvasird wallet faucet --stake on a local chain)"
        )
    print(f"start it with: kvasird --home {home.root} run")
    return 0
