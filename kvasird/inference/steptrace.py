"""Where a forwarded step's time goes, measured on the real route.

One decode step in TRACE_EVERY carries a `trace` list. Each hop appends its own stamps,
taken on its own clock (time.monotonic), and how long it waited for remote experts:

    [received, compute began, compute ended, handed on, experts waited]

`received` is when its frame was read (`channel.serve`), `handed on` when its output went
to the transport. The gateway notes when it sent the step and when the result arrived.
Only differences on one clock are used, so hops on other machines are measured as well:

    queue    received -> compute began     Python dispatch, decoding the step
    compute  compute began -> ended        the stage's graphs (with any wait for a stage
                                           busy with another session, and remote experts)
    experts  of compute, awaiting remote expert workers (also from a step run in a worker
             thread: trio carries the context variable there and back)
    after    compute ended -> handed on    encoding the output, sampling at the head
    wire     the step's whole time minus every hop's (received -> handed on): framing,
             encryption, the network, and each receiver waking up to read
    gateway  the previous token arrived -> this step was sent: handing the token to the
             client and starting the step, on the gateway's own clock

The gateway keeps the last TRACES_KEPT of them; the admin API shows their medians.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

TRACE_EVERY = 4
"""One forwarded decode step in this many is traced."""
TRACES_KEPT = 256


EXPERT_WAIT: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "expert_wait", default=None
)
"""Where the step a stage computes adds up its waits for remote experts (seconds)."""


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Count the block's time into the current step's EXPERT_WAIT, when it is collected."""
    total = EXPERT_WAIT.get()
    began = time.perf_counter()
    try:
        yield
    finally:
        if total is not None:
            total[0] += time.perf_counter() - began


@contextlib.contextmanager
def collecting_waits() -> Iterator[list[float]]:
    """Collect the remote-expert waits of the step run in the block (and the tasks it
    starts): [seconds]."""
    total = [0.0]
    token = EXPERT_WAIT.set(total)
    try:
        yield total
    finally:
        EXPERT_WAIT.reset(token)


@dataclass(frozen=True)
class StepTrace:
    route: tuple[str, ...]
    """The hops' peers, in order."""
    total_ms: float
    """Sent by the gateway -> result received."""
    hops: tuple[tuple[float, float, float, float], ...]
    """(queue, compute, after, experts) per hop, ms; experts: the part of compute spent
    waiting for remote expert workers."""
    gateway_ms: float | None = None
    """The previous step's token arrived -> this step was sent: the gateway's own time
    between steps (handing the token to the client, starting the step)."""
    links: tuple[float, ...] = ()
    """Per link of the circuit, ms from one end handing the step on (the gateway sending
    it) to the other reading it (the gateway its result): meaningful only where every hop
    reads the same monotonic clock (hops on one machine, as a benchmark's namespaces)."""

    @property
    def wire_ms(self) -> float:
        return self.total_ms - sum(sum(h[:3]) for h in self.hops)

    @classmethod
    def parse(
        cls, route: tuple[str, ...], sent: float, got: float, stamps: Any, previous: float = 0.0
    ) -> StepTrace | None:
        """From the hops' stamps; None when they are not one well-formed stamp per hop."""
        if not isinstance(stamps, list) or len(stamps) != len(route):
            return None
        hops, edges = [], [sent]
        for s in stamps:
            if not isinstance(s, list) or len(s) != 5 or not all(isinstance(t, float) for t in s):
                return None
            received, began, ended, handed_on, waited = s
            hop = (
                (began - received) * 1000,
                (ended - began) * 1000,
                (handed_on - ended) * 1000,
                waited * 1000,
            )
            if min(hop) < 0 or hop[3] > hop[1]:
                return None
            hops.append(hop)
            edges += [received, handed_on]
        gap = (sent - previous) * 1000 if 0 < previous <= sent else None
        edges.append(got)
        links = tuple(
            round((b - a) * 1000, 3) for a, b in zip(edges[::2], edges[1::2], strict=True)
        )
        return cls(route, (got - sent) * 1000, tuple(hops), gap, links)


class Traces:
    """The last traced steps, summarised for the admin API and the benchmark."""

    def __init__(self) -> None:
        self.kept: deque[StepTrace] = deque(maxlen=TRACES_KEPT)

    def add(self, trace: StepTrace | None) -> None:
        if trace is not None:
            self.kept.append(trace)

    def summary(self) -> dict[str, Any]:
        """Medians over the traced steps of the latest route taken ({} before any)."""
        if not self.kept:
            return {}
        route = self.kept[-1].route
        same = [t for t in self.kept if t.route == route]

        def med(values: list[float]) -> float:
            return round(statistics.median(values), 3)

        gaps = [t.gateway_ms for t in same if t.gateway_ms is not None]
        last = self.kept[-1]
        return {
            "last": {
                "total_ms": round(last.total_ms, 3),
                "wire_ms": round(last.wire_ms, 3),
                "hops_ms": [round(sum(h[:3]), 3) for h in last.hops],
                "links_ms": list(last.links),
            },
            "steps": len(same),
            "route": list(route),
            "total_ms": med([t.total_ms for t in same]),
            "wire_ms": med([t.wire_ms for t in same]),
            "gateway_ms": med(gaps) if gaps else None,
            "hops": [
                {
                    "peer": peer,
                    **{
                        f"{name}_ms": med([t.hops[i][k] for t in same])
                        for k, name in enumerate(("queue", "compute", "after", "experts"))
                    },
                }
                for i, peer in enumerate(route)
            ],
        }
