"""``kvasird status``: what the running daemon is doing."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvasird.admin import client
from kvasird.cli import home_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="status of the running daemon")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    home = home_of(args)
    status = {**client.get(home, "/v0/status"), **client.get(home, "/v0/serving")}
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    for label, value in lines(status):
        print(f"{label:12} {value}")
    return 0


def lines(status: dict[str, Any]) -> list[tuple[str, str]]:
    """The status as labelled lines: who the node is, what it serves and holds, whether its
    gateway can answer, and what it earned."""
    out = [
        ("peer id", status["peer_id"]),
        ("network", status["network"]),
        ("version", f"kvasird {status['version']} (protocol {status['protocol']})"),
        ("uptime", f"{status['uptime_s']:.0f} s"),
    ]
    model = status.get("model")
    out.append(
        (
            "model",
            f"{model['name']} ({model['id']})"
            if model
            else "none (set [market] model, or `kvasird init --model`)",
        )
    )
    if (role := status.get("role")) is not None:
        out.append(("role", _role(role)))
    out.append(("gateway", status.get("gateway") or "off"))
    if (health := status.get("health")) is not None:
        out.append(("health", f"{health['status']}: {health['reason']}"))
    out.append(("peers", str(status["peers"])))
    if (earned := status.get("earnings")) is not None:
        from kvasird.settlement.token import format_kvr  # deferred: loads solders and spl

        out.append(
            (
                "earnings",
                f"{format_kvr(earned['pending'])} KVR pending "
                f"(`kvasird wallet claim`), {format_kvr(earned['received'])} "
                f"claimed, {format_kvr(earned['earned'])} earned from "
                f"{earned['gateways']} gateway(s)",
            )
        )
    else:
        out.append(("earnings", "settlement is off (serving for free)"))
    if reach := status.get("reachability") or {}:
        out.append(("reachability", reach.get("verdict", "unknown")))
    out += [("listening", addr) for addr in status["listen_addrs"]]
    return out


def _role(role: dict[str, Any]) -> str:
    units = role["units"]
    if not units:
        return f"holds no units ({role['state']}): a gateway and client only"
    shown = ", ".join(units[:6]) + (f" and {len(units) - 6} more" if len(units) > 6 else "")
    return (
        f"holds {len(units)} unit{'s' if len(units) != 1 else ''} ({shown}), "
        f"{role['held_bytes'] / 2**20:.1f} of {role['budget_bytes'] / 2**20:.1f} MiB"
    )
