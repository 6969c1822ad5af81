"""Serving an ASGI app with hypercorn inside a trio nursery (admin API, gateway)."""

from __future__ import annotations

import logging

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from kvasird.errors import ConfigError


async def serve_asgi(app, bind: str, *, what: str, config_hint: str,  # noqa: ANN001 - any ASGI app
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``bind`` (host:port, port 0 = free); report the real URL when listening."""
    cfg = HypercornConfig()
    cfg.bind = [bind]
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.graceful_timeout = 2.0
    try:
        await serve(app, cfg, task_status=_FirstBind(task_status))
    except OSError as exc:
        raise ConfigError(f"cannot listen for the {what} on {bind} ({exc.strerror}): "
                          f"set {config_hint} to a free port") from None


class _FirstBind:
    """Adapts hypercorn's started(list of binds) to started(first URL)."""

    def __init__(self, status: trio.TaskStatus[str]) -> None:
        self._status = status

    def started(self, binds: list[str] | None = None) -> None:
        self._status.started((binds or [""])[0])
