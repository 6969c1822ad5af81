"""The life of a served stream: bounded, quiet on peer failures, always closed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from kvasird.errors import WireError
from kvasird.logs import get_logger

log = get_logger("kvasird.p2p.streams")


@asynccontextmanager
async def served(stream: Any, what: str, peer: str, *, reset: bool = False) -> AsyncIterator[None]:
    """Run a stream handler's body; a misbehaving or vanished peer ends it with a debug line.

    The stream is closed (or reset) afterwards, shielded and bounded in time: py-libp2p's
    close can block on a dead connection.
    """
    try:
        yield
    except (trio.TooSlowError, WireError) as exc:
        log.debug(f"{what} stream ended", peer=peer, reason=repr(exc))
    except Exception as exc:  # noqa: BLE001 - the stream layer raises many types on reset
        log.debug(f"{what} stream failed", peer=peer, reason=repr(exc))
    finally:
        with trio.move_on_after(1) as scope:
            scope.shield = True
            with contextlib.suppress(Exception):  # the stream is already gone
                await (stream.reset() if reset else stream.close())
