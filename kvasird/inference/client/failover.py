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
    Lied                     ─▶ avoided unfit_s as a liar (routing.Fitness.mark), restarts
                                or not: a stage that accused two different peers of sending
                                it NaN within ACCUSED_WITHIN_S (Accusations)

A stage handed NaN or infinite hidden rows by the hop before it (a peer that does not
check its own output) names that hop in its Failure, with the code "broken". The gateway
sentences the accused as if it had refused its own output, unless ``Accusations`` finds the
accuser not credible: see there.

This node never sentences itself. The generation then closes the old route's sessions,
plans a new route from the fit peers, and replays the token history there as a prefill;
the new head continues the seeded sampling stream where the old one stopped (``draws``).
"""

from __future__ import annotations

import trio

from kvasird.inference.api import Busy, GenerationError, NotServed
from kvasird.inference.client.routing import Fitness
from kvasird.inference.errors import HopFailed, Refused, sentence

BUSY_BACKOFF_S = 5.0
"""A peer that refused for lack of capacity is avoided this long."""
ACCUSED_WITHIN_S = 120.0
"""An accuser that names a second sender within this long of naming another is a liar."""


class Lied(HopFailed):
    """The peer said what is not so (it accused peers that did nothing): routed around
    as a liar, for the configured unfit_s."""


class Accusations:
    """Who accused whom, lately, of sending NaN or infinite hidden states.

    An accusation cannot be checked (the rows are gone), so the rule is about the accuser:
    a healthy stage behind a broken peer names that peer, as often as it is routed behind
    it again; a stage that lies about its input (to shed work, or to push a rival out of
    routes) names whoever feeds it, so once the first accused is avoided it names the
    replica it is routed behind next. So the first accusation is taken (the accused is
    sentenced as for refusing its own output); one naming a different sender within
    ACCUSED_WITHIN_S of another is not, and its accuser is sentenced as a liar instead
    (the first accused keeps its short sentence). The price is a healthy stage fed by two
    broken peers within that time, which is taken for a liar: rare, and no worse than
    being blamed for their output as before. Our own stage server (`me`) checks its output
    before it sends it: an accusation of us is a lie, and our own are taken as made."""

    def __init__(self, me: str, within_s: float = ACCUSED_WITHIN_S) -> None:
        self.me, self.within_s = me, within_s
        self._heard: dict[str, list[tuple[float, str]]] = {}
        """Accuser -> (when, accused) of its accusations within within_s."""

    def weigh(self, accuser: str, accused: str, detail: str) -> HopFailed:
        """The failure to act on after `accuser` said `accused` sent it unusable rows."""
        if accused == self.me:
            return Lied(
                accuser,
                f"accused this node, which checks its own output, of "
                f"sending NaN or infinite hidden states: {detail}",
            )
        if accuser != self.me:
            now = trio.current_time()
            self._heard = {
                a: kept
                for a, heard in self._heard.items()
                if (kept := [h for h in heard if now - h[0] < self.within_s])
            }
            heard = self._heard.setdefault(accuser, [])
            heard.append((now, accused))
            if len(named := {peer for _, peer in heard}) > 1:
                return Lied(
                    accuser,
                    f"accused {len(named)} different peers of sending it "
                    f"NaN or infinite hidden states within "
                    f"{self.within_s:g} s: {detail}",
                )
        return Refused(accused, "broken", f"{detail} (said the hop after it, {accuser[:16]})")


def judge(exc: HopFailed, attempt: int, *, max_failovers: int, me: str, fitness: Fitness) -> str:
    """Sentence the peer `exc` names for failover number `attempt` (1, 2, …), or raise the
    error that ends the generation. Returns the capacity refusal's reason ("" if none)."""
    busy = exc.detail if isinstance(exc, Refused) and exc.code == "busy" else None
    if attempt > max_failovers:
        if busy is not None:
            raise Busy(f"the route is out of capacity ({busy}): retry shortly") from exc
        raise GenerationError(
            f"gave up after {max_failovers} route rebuilds; last failure: {exc}"
        ) from exc
    if isinstance(exc, Refused) and exc.code == "unpaid":
        raise NotServed(exc.detail) from exc
    if exc.peer == me:
        return ""  # our own hop failing is not a peer to avoid
    if isinstance(exc, Lied):
        fitness.mark(exc.peer, exc.reason)
        return ""
    if busy is not None:
        fitness.mark(exc.peer, exc.reason, BUSY_BACKOFF_S, lied=False)
        return busy
    if exc.peer:
        fitness.failed(exc.peer, exc.reason, sentence(exc))
    return ""
