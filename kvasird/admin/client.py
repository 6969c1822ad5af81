"""Reaching the running daemon of a home from the CLI."""

from __future__ import annotations

from typing import Any

import httpx

from kvasird.errors import DaemonNotRunning
from kvasird.home import Home


def get(home: Home, path: str, timeout: float = 5.0) -> Any:
    url = home.admin_address()
    if url is None:
        raise DaemonNotRunning(f"no daemon is running for {home.root}: start it with "
                               f"`kvasird --home {home.root} run`")
    try:
        resp = httpx.get(url + path, timeout=timeout)
    except httpx.HTTPError as exc:
        raise DaemonNotRunning(f"the daemon for {home.root} does not answer at {url} ({exc}); "
                               "if it crashed, start it again with `kvasird run`") from None
    resp.raise_for_status()
    return resp.json()
