"""Logging: structlog everywhere, JSON lines off a terminal (journald), text on one.

The stdlib loggers of our dependencies (libp2p prints raw warnings otherwise, STACK.md)
are routed through the same renderer, so nothing reaches stderr unformatted.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}
# Dependencies are chatty at INFO; keep them at WARNING unless we run at debug.
_QUIET = ("libp2p", "multiaddr", "httpx", "httpcore", "hypercorn", "trio_websocket", "asyncio")


def configure(level: str = "info", json: bool | None = None) -> None:
    json = (not sys.stderr.isatty()) if json is None else json
    numeric = _LEVELS[level]
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    ))
    if numeric > logging.DEBUG:
        handler.addFilter(_quiet_dependencies)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def _quiet_dependencies(record: logging.LogRecord) -> bool:
    """Drop dependencies' records below WARNING (libp2p sets INFO on its own loggers)."""
    return record.levelno >= logging.WARNING or not record.name.startswith(_QUIET)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
