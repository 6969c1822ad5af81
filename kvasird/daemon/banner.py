"""The startup banner: everything an operator needs to copy; then a single "ready" once the
node serves, and until then a line saying what it waits for."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvasird import logs
from kvasird.errors import KvasirError

if TYPE_CHECKING:
    from kvasird.model.ref import ModelRef


def print_banner(
    status: dict[str, Any], admin_url: str, config_path: str, risks: Sequence[str] = ()
) -> None:
    """On a terminal (or with text logs) as text; with JSON logs as one "banner" event.
    ``risks`` (risky settings, kvasird.daemon.risks) come last, a line each; "ready" follows
    once the node serves (print_ready)."""
    join = status["join_addr"]
    try_it = _try_it(status.get("gateway") or "", config_path)
    lines = [
        f"kvasird {status['version']}",
        f"peer id      {status['peer_id']}",
        f"network      {status['network']}",
        *(f"listening    {a}" for a in status["listen_addrs"]),
        f"admin API    {admin_url}",
        *([f"gateway      {status['gateway']}"] if status.get("gateway") else []),
        f"config       {config_path}",
        *try_it,
        "join this node from another one with:",
        f"    kvasird init --network {status['network']} --bootstrap {join}"
        if join
        else "    (no dialable address: set [p2p] listen or announce)",
        *(f"warning      {risk}" for risk in risks),
    ]
    logs.banner(
        "\n".join(lines),
        version=status["version"],
        peer_id=status["peer_id"],
        network=status["network"],
        listen_addrs=status["listen_addrs"],
        admin=admin_url,
        gateway=status.get("gateway"),
        config=config_path,
        join=join,
        model=try_it[0].split(None, 1)[1] if try_it else None,
        ask=try_it[-1].strip() if try_it else None,
        warnings=list(risks),
    )


def print_waiting(status: str) -> None:
    """What the node waits for before it serves: "waiting (<its gateway's health>): why"."""
    logs.announce(status, "waiting to serve", status=status)


def print_ready(peer_id: str, admin_url: str, serving: str) -> None:
    """The node serves: its gateway answers requests, or it has no model to serve."""
    logs.announce(
        f"ready        {serving}", "ready", peer_id=peer_id, admin=admin_url, serving=serving
    )


def _try_it(gateway: str, config_path: str) -> list[str]:
    """The model's name and a request to copy, when the gateway serves one."""
    name = _model_name(config_path) if gateway else None
    if name is None:
        return []
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}]})
    return [
        f"model        {name}",
        "ask it from this machine with:",
        f"    curl -s {gateway}/v1/chat/completions -H 'content-type: application/json' "
        f"-d '{body}'",
    ]


def _model_name(config_path: str) -> str | None:
    """The [market] model's name (``family:tag``), which every node's gateway answers to:
    the one the shard store lists it under (chosen by `kvasird model add --name`, or given
    by the network), else the one its GGUF's metadata gives, else the name or id the
    config names it by. None when the node serves no model or its GGUF is not readable yet
    (the gateway's log says why)."""
    from kvasird.compute.ggufview import GGUFFile
    from kvasird.config.load import load
    from kvasird.home import Home
    from kvasird.model.names import model_name
    from kvasird.model.ref import ModelRef
    from kvasird.model.store import ShardStore

    try:
        text = load(Path(config_path)).market.model
        if not text:
            return None
        ref = ModelRef.parse(text)
        home = Home(Path(config_path).parent)
        listed: dict[str, str] = {}
        if home.db.exists():  # a home its daemon has started in, not a bare config file
            with ShardStore.open(home) as store:
                listed = {m.source: m.name for m in store.models()}
                with contextlib.suppress(KvasirError):
                    listed[ref.value] = store.name_of(store.resolve(ref.value)) or ref.value
        if ref.from_peers or str(ref) in listed:
            return listed.get(str(ref), ref.value)
        path = _gguf_on_disk(ref)
        return None if path is None else model_name(GGUFFile(path).metadata, path.name)
    except (KvasirError, OSError):
        return None


def _gguf_on_disk(ref: ModelRef) -> Path | None:
    """The GGUF of a path or bundled:NAME if it is here now: the banner never waits for the
    bundled model's download (the market does that, off the event loop)."""
    from kvasird.model import bundled
    from kvasird.model.ref import BUNDLED

    if ref.kind == "path":
        return Path(ref.value)
    if BUNDLED.get(ref.value) is bundled.bundled_path:
        return bundled.bundled_path(fetch=False)  # raises while it is missing
    return None
