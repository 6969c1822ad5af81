"""What the gateway has served: requests, tokens, time to first token, decode speed.

Every generation holds a Slot from admission to its last byte; the number of slots is
the concurrency limit (HTTP 429 past it), and a finished slot adds its numbers to the
recent window the status page reports, and to the per-interval series its charts draw.
The same numbers, counted once here, are what /metrics exports (gateway.metrics): the
totals since start, the HTTP requests by route and status, and histograms of the time to
first token and of the gaps between tokens.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass
from itertools import accumulate
from statistics import median
from typing import Any

from kvasird.gateway.errors import TooManyRequests

RECENT = 64
"""Requests the rates are computed over."""
SERIES_S = 5.0
"""Width of one interval of the charts' series."""
SERIES_LEN = 60
"""Intervals kept (five minutes)."""
ROUTES = 8
"""Routes remembered for the status page."""
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the time-to-first-token histogram: a local model answers in
tens of milliseconds, a route of peers across the internet in seconds."""
GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds (seconds) of the histogram of gaps between tokens: one ring circuit a
token, from a few milliseconds on loopback to seconds behind a lost packet."""


@dataclass(frozen=True)
class Served:
    """One finished generation."""

    ttft_s: float
    """Seconds from admission to the first token."""
    tokens: int
    """Tokens generated."""
    decode_s: float
    """Seconds from the first token to the last."""
    at: float = 0.0
    """When it finished (time.monotonic)."""


class Histogram:
    """Observations counted into buckets of fixed upper bounds, as Prometheus keeps them:
    a scrape reads counts that only grow, and rates and quantiles are computed there."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        """Observations per bucket (not cumulative); the last is above every bound."""
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), ending with (inf, all of them)."""
        return list(zip((*self.bounds, math.inf), accumulate(self.counts), strict=True))


class GatewayStats:
    def __init__(self) -> None:
        self.in_flight = 0
        self.waiting = 0
        """Generations admitted that have no token yet (waiting for a route, the KV cache,
        their prefill)."""
        self.by_status: Counter[int] = Counter()
        self.requests: Counter[tuple[str, str, int]] = Counter()
        """HTTP requests answered, by route (its path template), method and status."""
        self.tokens = 0
        self.prompt_tokens = 0
        """Prompt tokens of the generations that finished (once per request: its choices
        share the prompt)."""
        self.ttft = Histogram(TTFT_BUCKETS)
        """Seconds from admission to a request's first token."""
        self.gaps = Histogram(GAP_BUCKETS)
        """Seconds between one choice's tokens as the gateway hands them on."""
        self.recent: deque[Served] = deque(maxlen=RECENT)
        self.history: deque[Served] = deque(maxlen=4096)
        """What finished in the last SERIES_LEN intervals (older entries are dropped)."""
        self.routes: dict[tuple[str, ...], float] = {}
        """Route (its peers in order) -> when a generation was last seen on it."""

    def admit(self, limit: int) -> Slot:
        if self.in_flight >= limit:
            self.by_status[429] += 1
            raise TooManyRequests(
                f"{limit} generations are in flight, the gateway's limit "
                "([gateway] max_concurrent): retry shortly",
                code="concurrency",
            )
        return Slot(self)

    def answered(self, route: str, method: str, status: int) -> None:
        """An HTTP request was answered (gateway.metrics.CountRequests counts them)."""
        self.requests[route, method, status] += 1

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

    def series(self, now: float | None = None) -> list[dict[str, Any]]:
        """Per interval of SERIES_S seconds, oldest first: tokens per second generated and
        the median time to first token (None when nothing finished in it)."""
        now = time.monotonic() if now is None else now
        start = now - SERIES_LEN * SERIES_S
        tokens = [0.0] * SERIES_LEN
        firsts: list[list[float]] = [[] for _ in range(SERIES_LEN)]
        for s in self.history:
            # a generation's tokens are spread over the time it decoded them
            t0 = s.at - s.decode_s
            last = min(_bucket(s.at, start), SERIES_LEN - 1)
            for i in range(max(_bucket(t0, start), 0), last + 1):
                lo, hi = start + i * SERIES_S, start + (i + 1) * SERIES_S
                share = (min(hi, s.at) - max(lo, t0)) / s.decode_s if s.decode_s > 0 else 1.0
                tokens[i] += s.tokens * share
            if 0 <= (i := _bucket(t0, start)) < SERIES_LEN:
                firsts[i].append(s.ttft_s)
        return [
            {
                "tokens_per_s": round(n / SERIES_S, 2),
                "ttft_ms": round(median(f) * 1000) if f else None,
            }
            for n, f in zip(tokens, firsts, strict=True)
        ]

    def saw_routes(self, routes: list[tuple[str, ...]], now: float | None = None) -> None:
        """Generations were running on ``routes`` just now; only the newest ROUTES are kept."""
        now = time.monotonic() if now is None else now
        for route in routes:
            if route:
                self.routes[route] = now
        for old in sorted(self.routes, key=self.routes.__getitem__)[:-ROUTES]:
            del self.routes[old]

    def recent_routes(self, now: float | None = None) -> list[dict[str, Any]]:
        now = time.monotonic() if now is None else now
        return [
            {"peers": list(r), "seen_s_ago": round(now - t, 1)}
            for r, t in sorted(self.routes.items(), key=lambda rt: -rt[1])
        ]


def _bucket(t: float, start: float) -> int:
    return int((t - start) // SERIES_S)


class Slot:
    """One admitted generation; a context manager that frees its place when left."""

    def __init__(self, stats: GatewayStats) -> None:
        self._stats = stats
        self._t0 = time.monotonic()
        self._first: float | None = None
        self._last: dict[int, float] = {}
        """When each choice last handed on tokens."""
        self.finished = False
        self.completion_tokens = 0
        """Tokens generated, once finished with status 200."""
        stats.in_flight += 1
        stats.waiting += 1

    def first_token(self) -> None:
        self._first = time.monotonic()
        self._stats.waiting -= 1
        self._stats.ttft.observe(self._first - self._t0)

    def tokens(self, choice: int, n: int) -> None:
        """Choice ``choice`` hands on ``n`` more tokens. Its first ones start its clock (the
        time to them is the time to first token); later ones each count an equal share of
        the gap since its previous ones (text held back for a stop sequence or a split
        character leaves as one piece of several tokens)."""
        if n < 1:
            return
        now = time.monotonic()
        last = self._last.get(choice)
        self._last[choice] = now
        if last is not None:
            self._stats.gaps.observe((now - last) / n, n)

    def finish(self, status: int, tokens: int = 0, prompt_tokens: int = 0) -> None:
        self.finished = True
        self.completion_tokens = tokens
        stats = self._stats
        stats.by_status[status] += 1
        stats.tokens += tokens
        stats.prompt_tokens += prompt_tokens
        if status == 200 and self._first is not None:
            now = time.monotonic()
            served = Served(self._first - self._t0, tokens, now - self._first, now)
            stats.recent.append(served)
            stats.history.append(served)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stats.in_flight -= 1
        if self._first is None:
            self._stats.waiting -= 1
        if not self.finished:
            self._stats.by_status[499] += 1
