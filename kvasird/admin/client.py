"""Reaching the running daemon of a home from the CLI.

Plain ``http.client`` on purpose: ``kvasird status`` and ``peers`` load nothing else, so
they answer as fast as the interpreter starts. The admin API is on loopback, never behind
a proxy.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

from kvasird.errors import DaemonNotRunning, KvasirError
from kvasird.home import Home


def get(home: Home, path: str, timeout: float = 5.0) -> Any:
    status, body = _call(home, "GET", path, timeout)
    if status != 200:
        raise KvasirError(
            f"the daemon for {home.root} answered {status} to GET {path}: "
            f"{body[:300].decode('utf-8', 'replace')}"
        )
    return _json(home, path, body)


def post(home: Home, path: str, timeout: float = 120.0, body: Any = None) -> Any:
    """POST ``body`` (as JSON, if any) to the running daemon's admin API; its JSON answer,
    errors included."""
    return _json(home, path, _call(home, "POST", path, timeout, body)[1])


def _json(home: Home, path: str, body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        raise KvasirError(
            f"the daemon for {home.root} answered {path} with something other "
            f"than JSON: {body[:300].decode('utf-8', 'replace')}"
        ) from None


def _call(
    home: Home, method: str, path: str, timeout: float, body: Any = None
) -> tuple[int, bytes]:
    url = home.admin_address()
    if url is None:
        raise DaemonNotRunning(
            f"no daemon is running for {home.root}: start it with `kvasird --home {home.root} run`"
        )
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=timeout)
    try:
        if body is None:
            conn.request(method, where.path.rstrip("/") + path)
        else:
            conn.request(
                method,
                where.path.rstrip("/") + path,
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        raise DaemonNotRunning(
            f"the daemon for {home.root} does not answer at {url} ({exc}); "
            "if it crashed, start it again with `kvasird run`"
        ) from None
    finally:
        conn.close()
