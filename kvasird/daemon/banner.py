"""The startup banner: everything an operator needs to copy, then a single "ready"."""

from __future__ import annotations

import sys
from typing import Any


def print_banner(status: dict[str, Any], admin_url: str, config_path: str) -> None:
    join = status["join_addr"]
    lines = [
        f"kvasird {status['version']}",
        f"peer id      {status['peer_id']}",
        f"network      {status['network']}",
        *(f"listening    {a}" for a in status["listen_addrs"]),
        f"admin API    {admin_url}",
        *([f"gateway      {status['gateway']}"] if status.get("gateway") else []),
        f"config       {config_path}",
        "join this node from another one with:",
        f"    kvasird init --network {status['network']} --bootstrap {join}" if join else
        "    (no dialable address: set [p2p] listen or announce)",
        "ready",
    ]
    print("\n".join(lines), flush=True, file=sys.stdout)
