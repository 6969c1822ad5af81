"""Logging: structlog everywhere, JSON lines off a terminal (journald), text on one.

The stdlib loggers of our dependencies (libp2p prints raw warnings otherwise, STACK.md)
are routed through the same renderer, so nothing reaches stderr unformatted: libp2p turns
off propagation from its loggers, so the renderer is also the handler of last resort, and
Python's warnings are logged. With JSON logs and stdout off a terminal, what anything
prints to stdout becomes a log event too (the journal then holds only JSON), and the
banner one event with its fields.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
from typing import Any

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
# Dependencies are chatty at INFO; keep them at WARNING unless we run at debug.
_QUIET = ("libp2p", "multiaddr", "httpx", "httpcore", "hypercorn", "trio_websocket", "asyncio")
_DEBUG_ONLY = {
    # An inbound connection closed after its security handshake: that is how a peer's
    # reachability probe ends (kvasird.p2p.reachability dials us back, proves our peer id
    # over Noise and hangs up without negotiating a muxer), so every node that joins one
    # saw this logged as an error at start, and nothing was wrong.
    "libp2p.network.swarm": (
        "fail to upgrade mux for peer",
        # Our dialer reports a failed dial once, with its reason and
        # what to check (kvasird.p2p.dialer); the swarm logs every try.
        "failed to upgrade security for peer",
    ),
    # One line per TCP attempt, four per dial; the dialer's warning says it once.
    "libp2p.transport.tcp.tcp": ("Failed to open TCP stream",),
}
"""Dependencies' records, by logger and message start, that are noise unless we run at
debug: harmless, or said once and better by our own code."""

_json = False
"""Whether configure() chose JSON lines."""


def configure(level: str = "info", json: bool | None = None) -> None:
    global _json
    json = (not sys.stderr.isatty()) if json is None else json
    _json = json
    numeric = _LEVELS[level]
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    if numeric > logging.DEBUG:
        handler.addFilter(_quiet_dependencies)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    logging.lastResort = handler
    logging.captureWarnings(True)
    if json and not isinstance(sys.stdout, _PrintsToLog) and not sys.stdout.isatty():
        sys.stdout = _PrintsToLog(logging.getLogger("stdout"))


def banner(text: str, **fields: Any) -> None:
    """Show the startup banner: as text on a terminal (or with text logs), else as one
    "banner" event with ``fields`` (the journal of a service holds only JSON)."""
    announce(text, "banner", **fields)


def announce(text: str, event: str, **fields: Any) -> None:
    """Tell the operator ``text`` on a terminal (or with text logs), else log ``event``
    with ``fields``."""
    if _json and not sys.stdout.isatty():
        get_logger("kvasird.daemon").info(event, **fields)
    else:
        print(text, flush=True, file=sys.stdout)


class _PrintsToLog(io.TextIOBase):
    """stdout that logs what is printed: one INFO event per completed print (or flush)."""

    encoding = "utf-8"

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._pending = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            done = self._pending.endswith("\n")
        if done:
            self.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            text, self._pending = self._pending.rstrip("\n"), ""
        if text:
            self._logger.info(text)


def _quiet_dependencies(record: logging.LogRecord) -> bool:
    """Drop dependencies' records below WARNING (libp2p sets INFO on its own loggers), and
    those of _DEBUG_ONLY."""
    if str(record.msg).startswith(_DEBUG_ONLY.get(record.name, ())):
        return False
    return record.levelno >= logging.WARNING or not record.name.startswith(_QUIET)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
