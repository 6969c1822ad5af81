"""Where a forwarded step's time goes, measured on the real route.

One decode step in TRACE_EVERY carries a `trace` list. Each hop appends its own stamps,
taken on its own clock (time.monotonic):

    [received, compute began, compute ended, handed on]

`received` is when its frame was read (`channel.serve`), `handed on` when its output went
to the transport. The gateway notes when it sent the step and when the result arrived.
Only differences on one clock are used, so hops on other machines are measured as well:

    queue    received -> compute began     decoding the step, Python dispatch, a busy stage
    compute  compute began -> ended        the stage's graphs (and remote experts, if any)
    after    compute ended -> handed on    encoding the output, sampling at the head
    wire     the step's whole time minus every hop's (received -> handed on): framing,
             encryption, the network, and each receiver waking up to read
    gateway  the previous token arrived -> this step was sent: handing the token to the
             client and starting the step, on the gateway's own clock

The gateway keeps the last TRACES_KEPT of them; the admin API shows their medians.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

TRACE_EVERY = 4
"""One forwarded decode step in this many is traced."""
TRACES_KEPT = 256


@dataclass(frozen=True)
class StepTrace:
    route: tuple[str, ...]
    """The hops' peers, in order."""
    total_ms: float
    """Sent by the gateway -> result received."""
    hops: tuple[tuple[float, float, float], ...]
    """(queue, compute, after) per hop, ms."""
    gateway_ms: float | None = None
    """The previous step's token arrived -> this step was sent: the gateway's own time
    between steps (handing the token to the client, starting the step)."""

    @property
    def wire_ms(self) -> float:
        return self.total_ms - sum(sum(h) for h in self.hops)

    @classmethod
    def parse(cls, route: tuple[str, ...], sent: float, got: float, stamps: Any,
              previous: float = 0.0) -> StepTrace | None:
        """From the hops' stamps; None when they are not one well-formed stamp per hop."""
        if not isinstance(stamps, list) or len(stamps) != len(route):
            return None
        hops = []
        for s in stamps:
            if (not isinstance(s, list) or len(s) != 4
                    or not all(isinstance(t, float) for t in s)):
                return None
            spans = tuple((b - a) * 1000 for a, b in zip(s, s[1:], strict=False))
            if min(spans) < 0:
                return None
            hops.append(spans)
        gap = (sent - previous) * 1000 if 0 < previous <= sent else None
        return cls(route, (got - sent) * 1000, tuple(hops), gap)


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
        return {"steps": len(same), "route": list(route),
                "total_ms": med([t.total_ms for t in same]),
                "wire_ms": med([t.wire_ms for t in same]),
                "gateway_ms": med(gaps) if gaps else None,
                "hops": [{"peer": peer,
                          **{f"{name}_ms": med([t.hops[i][k] for t in same])
                             for k, name in enumerate(("queue", "compute", "after"))}}
                         for i, peer in enumerate(route)]}
