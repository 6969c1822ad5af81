"""What a step computes for, shared by the stage that runs it and the expert dispatcher.

A stage's MoE layers call the dispatcher through compute's hooks, which carry only rows
and ids; the dispatcher also needs to know whose session the rows belong to (to send the
gateway's delegation with its expert requests, and count the work for the session) and
how many decode steps are interleaved right now (to batch their rows into one message).
The stage server sets both here around a step; the dispatcher reads them (the step's
expert calls run in its context, on the loop or through a worker thread).

    Tally / TALLY      the session's owner, its delegation to this stage, and the expert
                       units done for it on other peers
    Company / COMPANY  decode steps interleaved on this node's stages now
"""

from __future__ import annotations

import contextvars
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Tally:
    """Expert work done on other peers for one session, as the stage that sent it counts."""

    owner: str
    """The gateway whose session it is."""
    delegation: bytes = b""
    """The owner's signed delegation to this stage (protocol.delegation), sent with every
    expert request made for the session: what lets a worker compute its rows."""
    experts: Counter[str] = field(default_factory=Counter)
    """Worker peer -> units (the experts its rows selected) it computed for this session."""


TALLY: contextvars.ContextVar[Tally | None] = contextvars.ContextVar("kvasird_tally", default=None)
"""The session a step computes for, read by the expert dispatcher (a step's expert calls
run in its own context, on the loop or through a worker thread)."""


class Company:
    """Decode steps interleaved on this node's stages right now: while more than one is,
    the expert dispatcher waits a moment to send rows of several sessions for one worker
    and layer as one message (experts.ExpertDispatcher.remote)."""

    def __init__(self) -> None:
        self.now = 0


COMPANY: contextvars.ContextVar[Company | None] = contextvars.ContextVar(
    "kvasird_company", default=None
)
