"""Reaching the running daemon of a home from the CLI."""

from __future__ import annotations

from typing import Any

import httpx

from kvasird.errors import DaemonNotRunning
from kvasird.home import Home


def get(home: Home, path: str, timeout: float = 5.0) -> Any:
    resp = _call(home, "GET", path, timeout)
    resp.raise_for_status()
    return resp.json()


def post(home: Home, path: str, timeout: float = 120.0) -> Any:
    """POST to the running daemon's admin API; its JSON answer, errors included."""
    return _call(home, "POST", path, timeout).json()


def _call(home: Home, method: str, path: str, timeout: float) -> httpx.Response:
    url = home.admin_address()
    if url is None:
        raise DaemonNotRunning(f"no daemon is running for {home.root}: start it with "
                               f"`kvasird --home {home.root} run`")
    try:
        return httpx.request(method, url + path, timeout=timeout)
    except httpx.HTTPError as exc:
        raise DaemonNotRunning(f"the daemon for {home.root} does not answer at {url} ({exc}); "
                               "if it crashed, start it again with `kvasird run`") from None
