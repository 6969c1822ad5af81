"""Checks every gossip record must pass after its schema: signer, sequence, clock, rate.

The gate keeps a misbehaviour count per peer (the signer of what it rejects), shown by
``kvasird coverage --json`` and the admin API, beside gossipsub's own score (which the
same rejections lower, through the topic validator's verdict).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvasird.errors import WireError

MAX_SKEW_S = 30.0
"""A record stamped further than this from our clock is not used (replays, broken clocks)."""
STALE_LIMIT_S = 600.0
"""Records older than this are refused as replays (counted); between MAX_SKEW_S and this
they are merely late (ignored, not counted)."""
RATE_BURST = 30.0
RATE_PER_S = 2.0


class Stale(Exception):
    """An older or duplicate record: normal in gossip (several paths), ignored, not punished."""


@dataclass
class _Bucket:
    tokens: float
    at: float


class RecordGate:
    def __init__(
        self, max_skew_s: float = MAX_SKEW_S, burst: float = RATE_BURST, per_s: float = RATE_PER_S
    ) -> None:
        self._skew = max_skew_s
        self._burst = burst
        self._rate = per_s
        self._last_seq: dict[tuple[str, str], int] = {}
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self.rejected: dict[str, int] = defaultdict(int)
        """Records refused per signer (schema, model bounds, or these checks)."""

    def check(
        self,
        topic: str,
        signer: str,
        peer: str,
        seq: int,
        ts: float,
        now: float,
        max_age_s: float = 0.0,
    ) -> None:
        """Raise WireError unless the record may be used (the caller counts the refusal).

        ``max_age_s``: a record may be this old (one fetched from a peer's map, stamped at
        its last keep-alive), not only the clock skew a fresh one may show."""
        if peer != signer:
            raise WireError(f"record claims peer {peer} but is signed by {signer}")
        if ts - now > self._skew or now - ts > max(STALE_LIMIT_S, max_age_s + self._skew):
            raise WireError(f"record time is {ts - now:+.0f} s off our clock")
        if now - ts > max(self._skew, max_age_s):
            # Late, not forged: a busy relay or a slow path. Too old to use, not punished.
            raise Stale(f"record is {now - ts:.0f} s old (limit {self._skew:g} s)")
        key = (topic, peer)
        if seq <= self._last_seq.get(key, -1):
            raise Stale(f"sequence number {seq} is not newer than {self._last_seq[key]}")
        self._take(key, now)
        self._last_seq[key] = seq

    def _take(self, key: tuple[str, str], now: float) -> None:
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(self._burst, now)
        b.tokens = min(self._burst, b.tokens + (now - b.at) * self._rate)
        b.at = now
        if b.tokens < 1:
            raise WireError("peer publishes records faster than the rate limit")
        b.tokens -= 1

    def forget(self, peer: str) -> None:
        """Drop per-peer state of a peer whose records expired (bounded memory)."""
        for d in (self._last_seq, self._buckets):
            for key in [k for k in d if k[1] == peer]:
                del d[key]
