"""Computations written as generators of what they need from outside, and their drivers.

A forward yields each thing it cannot do by itself (run a graph, get expert outputs) and
is sent the answer back. One body then serves both kinds of caller:

    drive(steps, serve)               a blocking caller answers every need itself
    await drive_async(steps, serve)   an event loop awaits the remote parts (expert calls on
                                      other peers) and runs the rest in place

so a stage that dispatches experts can take a decode step on the event loop, without a
worker thread that reaches back into the loop for every MoE layer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

R = TypeVar("R")
Steps = Generator[Any, Any, R]
"""Yields needs, is sent their answers, returns the result."""


def drive(steps: Steps[R], serve: Callable[[Any], Any]) -> R:
    """Run `steps` to the end, answering each need with serve(need)."""
    try:
        need = next(steps)
        while True:
            need = steps.send(serve(need))
    except StopIteration as done:
        return done.value
    finally:
        steps.close()


async def drive_async(steps: Steps[R], serve: Callable[[Any], Awaitable[Any]]) -> R:
    """Run `steps` to the end, answering each need with await serve(need)."""
    try:
        need = next(steps)
        while True:
            need = steps.send(await serve(need))
    except StopIteration as done:
        return done.value
    finally:
        steps.close()
