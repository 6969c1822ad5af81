"""What the gateway has served: requests, tokens, time to first token, decode speed.

Every generation holds a Slot from admission to its last byte; the number of slots is
the concurrency limit (HTTP 429 past it), and a finished slot adds its numbers to the
recent window the status page reports.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from statistics import median
from typing import Any

from kvasird.gateway.errors import TooManyRequests

RECENT = 64
"""Requests the rates are computed over."""


@dataclass(frozen=True)
class Served:
    """One finished generation."""

    ttft_s: float
    """Seconds from admission to the first token."""
    tokens: int
    """Tokens generated."""
    decode_s: float
    """Seconds from the first token to the last."""


class GatewayStats:
    def __init__(self) -> None:
        self.in_flight = 0
        self.by_status: Counter[int] = Counter()
        self.tokens = 0
        self.recent: deque[Served] = deque(maxlen=RECENT)

    def admit(self, limit: int) -> Slot:
        if self.in_flight >= limit:
            self.by_status[429] += 1
            raise TooManyRequests(f"{limit} generations are in flight, the gateway's limit "
                                  "([gateway] max_concurrent): retry shortly", code="concurrency")
        return Slot(self)

    def snapshot(self) -> dict[str, Any]:
        recent = list(self.recent)
        decode_s = sum(s.decode_s for s in recent)
        decoded = sum(max(s.tokens - 1, 0) for s in recent)
        return {
            "requests_served": sum(n for code, n in self.by_status.items() if code == 200),
            "requests_by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "in_flight": self.in_flight,
            "tokens_generated": self.tokens,
            "ttft_ms_median": round(median(s.ttft_s for s in recent) * 1000, 1) if recent else None,
            "decode_tokens_per_s": round(decoded / decode_s, 1) if decode_s > 0 else None,
        }


class Slot:
    """One admitted generation; a context manager that frees its place when left."""

    def __init__(self, stats: GatewayStats) -> None:
        self._stats = stats
        self._t0 = time.monotonic()
        self._first: float | None = None
        self.finished = False
        self.completion_tokens = 0
        """Tokens generated, once finished with status 200."""
        stats.in_flight += 1

    def first_token(self) -> None:
        self._first = time.monotonic()

    def finish(self, status: int, tokens: int = 0) -> None:
        self.finished = True
        self.completion_tokens = tokens
        stats = self._stats
        stats.by_status[status] += 1
        stats.tokens += tokens
        if status == 200 and self._first is not None:
            stats.recent.append(Served(self._first - self._t0, tokens,
                                       time.monotonic() - self._first))

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stats.in_flight -= 1
        if not self.finished:
            self._stats.by_status[499] += 1
