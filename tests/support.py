"""Waiting in tests: poll a condition until it holds, within a bound, and on failure say
what was awaited and what was last seen.

A test that waits on state it cannot be told about (another process's HTTP API, a node's
log, the state of tasks it does not own) polls it; nothing else should. ``eventually``
blocks (tests that drive daemons); ``eventually_async`` sleeps on trio's clock, so under a
``MockClock`` its bound and its pauses are virtual time.

Code that takes an injected clock (``clock: Callable[[], float]``) is driven by ``Clock``
instead: a test moves it by hand, and nothing waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import httpx
import trio

T = TypeVar("T")

NOT_YET: tuple[type[BaseException], ...] = ()
"""By default every exception of the probe is a failure, not a "not yet"."""

STARTING: tuple[type[BaseException], ...] = (httpx.HTTPError, KeyError, ValueError)
"""A daemon still starting: its API refuses the connection, or its answer lacks a field yet."""


@dataclass
class _Wait(Generic[T]):
    """One wait in progress: the probe's last value, and the failure that explains it."""

    what: str
    """What is awaited, as the failure message should name it ("node 2 lists the model")."""
    probe: Callable[[], T]
    """Reads the condition; the wait is over when it returns a truthy value."""
    not_yet: tuple[type[BaseException], ...]
    """Exceptions of the probe that mean "not yet" (a refused connection, a missing key)."""
    alive: Callable[[], bool]
    """False once waiting longer is pointless (the daemon under test exited)."""
    context: Callable[[], str]
    """Appended to a failure: what helps to see why (the ends of the daemons' logs)."""
    last: object = field(default=None, init=False)
    """The probe's last value, or the exception it last raised."""

    def holds(self) -> T | None:
        try:
            value = self.probe()
        except self.not_yet as e:
            self.last = e
            return None
        self.last = value
        return value if value else None

    def failure(self, why: str) -> AssertionError:
        tail = self.context()
        return AssertionError(f"{why} waiting until {self.what} (last seen: {self.last!r})"
                              + (f"\n{tail}" if tail else ""))

    def check_alive(self) -> None:
        if not self.alive():
            raise self.failure("stopped early (what it waited on is gone)")


def eventually(what: str, probe: Callable[[], T], *, timeout: float, every: float = 0.1,
               not_yet: tuple[type[BaseException], ...] = NOT_YET,
               alive: Callable[[], bool] = lambda: True,
               context: Callable[[], str] = lambda: "") -> T:
    """Call ``probe`` every ``every`` seconds until it returns a truthy value, and return
    that value. Past ``timeout`` seconds, or as soon as ``alive()`` is false, fail with
    ``what``, the last value seen and ``context()``."""
    wait = _Wait(what, probe, not_yet, alive, context)
    deadline = time.monotonic() + timeout
    while True:
        if (value := wait.holds()) is not None:
            return value
        wait.check_alive()
        if time.monotonic() > deadline:
            raise wait.failure(f"timed out after {timeout:g} s")
        time.sleep(every)


async def eventually_async(what: str, probe: Callable[[], T], *, timeout: float,
                           every: float = 0.05,
                           not_yet: tuple[type[BaseException], ...] = NOT_YET,
                           context: Callable[[], str] = lambda: "") -> T:
    """``eventually`` for trio tests polling state owned by tasks they cannot wait on: the
    timeout and the pauses run on trio's clock (virtual under a ``MockClock``)."""
    wait = _Wait(what, probe, not_yet, lambda: True, context)
    deadline = trio.current_time() + timeout
    while True:
        if (value := wait.holds()) is not None:
            return value
        if trio.current_time() > deadline:
            raise wait.failure(f"timed out after {timeout:g} s")
        await trio.sleep(every)


class Clock:
    """A clock a test moves by hand (``clock.now += 61``), for an injected ``clock``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
