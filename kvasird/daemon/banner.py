"""The startup banner: everything an operator needs to copy, then a single "ready"."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvasird import logs
from kvasird.errors import KvasirError

if TYPE_CHECKING:
    from kvasird.model.ref import ModelRef


def print_banner(status: dict[str, Any], admin_url: str, config_path: str,
                 risks: Sequence[str] = ()) -> None:
    """On a terminal (or with text logs) as text; with JSON logs as one "banner" event.
    ``risks`` (risky settings, kvasird.daemon.risks) come last before "ready", a line each."""
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
        f"    kvasird init --network {status['network']} --bootstrap {join}" if join else
        "    (no dialable address: set [p2p] listen or announce)",
        *(f"warning      {risk}" for risk in risks),
        "ready",
    ]
    logs.banner("\n".join(lines), version=status["version"], peer_id=status["peer_id"],
                network=status["network"], listen_addrs=status["listen_addrs"],
                admin=admin_url, gateway=status.get("gateway"), config=config_path,
                join=join, model=try_it[0].split(None, 1)[1] if try_it else None,
                ask=try_it[-1].strip() if try_it else None, warnings=list(risks))


def _try_it(gateway: str, config_path: str) -> list[str]:
    """The model's name and a request to copy, when the gateway serves one."""
    name = _model_name(config_path) if gateway else None
    if name is None:
        return []
    label, typed = name
    body = json.dumps({"model": typed, "messages": [{"role": "user", "content": "Hello!"}]})
    return [f"model        {label}" + (f" ({typed})" if typed != label else ""),
            "ask it from this machine with:",
            f"    curl -s {gateway}/v1/chat/completions -H 'content-type: application/json' "
            f"-d '{body}'"]


def _model_name(config_path: str) -> tuple[str, str] | None:
    """The [market] model's name and the name a request gives it (a model id is both: its
    GGUF comes from peers later). None when the node serves no model or its GGUF is not
    readable yet (the gateway's log says why)."""
    from kvasird.compute.ggufview import GGUFFile
    from kvasird.config.load import load
    from kvasird.model.names import human_name, slug
    from kvasird.model.ref import ModelRef

    try:
        text = load(Path(config_path)).market.model
        if not text:
            return None
        ref = ModelRef.parse(text)
        if ref.kind == "id":
            return ref.value, ref.value
        path = _gguf_on_disk(ref)
        if path is None:
            return None
        label = human_name(GGUFFile(path).metadata, path.name)
    except (KvasirError, OSError):
        return None
    return label, slug(label)


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
