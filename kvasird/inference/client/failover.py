"""Failover: what a failed hop means for a generation, and for the peer that failed.

When a hop fails, times out or refuses, the generation (swarm._Run) asks ``judge``:

    Refused "unpaid"         ─▶ NotServed: every peer applies the same rule, no route helps
    more than max_failovers  ─▶ Busy (the last refusal was for capacity) or GenerationError
    Refused "busy"           ─▶ the peer is avoided BUSY_BACKOFF_S; a route refused only for
                                capacity answers Busy at once instead of waiting for coverage
    Unreachable              ─▶ avoided errors.UNREACHABLE_S (it may only be not dialled yet)
    any other failure        ─▶ avoided errors.FAILED_S (a restart, a peer still loading);
                                Refused "broken" among them: the peer refused its own NaN
                                output (a corrupt slice), before the next hop could refuse
                                it as input and be blamed in its place
    (a failure in a row doubles the last two, up to the configured unfit_s; a peer that
    works again starts over: routing.Fitness.failed / healthy)

This node never sentences itself. The generation then closes the old route's sessions,
plans a new route from the fit peers, and replays the token history there as a prefill;
the new head continues the seeded sampling stream where the old one stopped (``draws``).
"""

from __future__ import annotations

from kvasird.inference.api import Busy, GenerationError, NotServed
from kvasird.inference.client.routing import Fitness
from kvasird.inference.errors import HopFailed, Refused, sentence

BUSY_BACKOFF_S = 5.0
"""A peer that refused for lack of capacity is avoided this long."""


def judge(exc: HopFailed, attempt: int, *, max_failovers: int, me: str,
          fitness: Fitness) -> str:
    """Sentence the peer `exc` names for failover number `attempt` (1, 2, …), or raise the
    error that ends the generation. Returns the capacity refusal's reason ("" if none)."""
    busy = isinstance(exc, Refused) and exc.code == "busy"
    if attempt > max_failovers:
        if busy:
            raise Busy(f"the route is out of capacity ({exc.detail}): retry shortly") from exc
        raise GenerationError(f"gave up after {max_failovers} route rebuilds; last failure: "
                              f"{exc}") from exc
    if isinstance(exc, Refused) and exc.code == "unpaid":
        raise NotServed(exc.detail) from exc
    if exc.peer == me:
        return ""  # our own hop failing is not a peer to avoid
    if busy:
        fitness.mark(exc.peer, exc.reason, BUSY_BACKOFF_S, lied=False)
        return exc.detail
    if exc.peer:
        fitness.failed(exc.peer, exc.reason, sentence(exc))
    return ""
