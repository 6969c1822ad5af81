"""A hop's ledgers: the commitment a close answers, the rows a reveal shows, and the bounds
on what is kept (closed sessions for KEEP_S, all rows within a byte budget), driven by an
injected clock."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.inference.errors import Refusal
from kvasird.inference.protocol.stage import STEP_DIGESTS, Closed, Revealed, Shown
from kvasird.inference.protocol.tensors import digest, encode, view
from kvasird.inference.server.ledger import Ledgers
from tests.support import Clock


def step(start: int, n: int = 1, width: int = 8) -> Shown:
    rows = view(encode(np.full((n, width), start, np.float32), "f16"), "x", ("f16",),
                (None, None))
    return Shown(start, rows, "f16", np.ascontiguousarray(rows * 2), "f16", n == 1)


def test_a_close_commits_to_every_step_and_a_reveal_shows_them_as_computed() -> None:
    ledgers = Ledgers(clock=Clock())
    ledgers.begin("s")
    steps = [step(0, 4), step(4), step(5)]
    for s in steps:
        ledgers.record("s", s)
    commitment = ledgers.close("s")
    assert len(commitment) == 3 * STEP_DIGESTS
    assert commitment[STEP_DIGESTS:2 * STEP_DIGESTS] == \
        digest(steps[1].x, "f16") + digest(steps[1].out, "f16")
    assert Closed.from_wire(Closed(steps=commitment).to_wire()).steps == commitment
    shown = Revealed.from_wire(Revealed(ledgers.show("s", 1, 2)).to_wire()).steps
    assert [s.start for s in shown] == [4, 5]
    assert all(digest(a.x, a.dt) == digest(b.x, b.dt) for a, b in zip(shown, steps[1:]))


def test_closed_sessions_are_kept_for_a_while_and_rows_within_a_budget() -> None:
    clock = Clock()
    ledgers = Ledgers(keep_s=10, keep_bytes=3 * step(0).x.nbytes * 2, clock=clock)
    ledgers.begin("a")
    ledgers.record("a", step(0))
    ledgers.close("a")
    clock.now = 11
    with pytest.raises(Refusal, match="closed too long ago"):
        ledgers.show("a", 0, 0)
    ledgers.begin("b")
    for t in range(5):  # two steps past the budget: digests only
        ledgers.record("b", step(t))
    assert ledgers.dropped == 2 and len(ledgers.close("b")) == 5 * STEP_DIGESTS
    assert len(ledgers.show("b", 0, 2)) == 3
    with pytest.raises(Refusal, match="not kept"):
        ledgers.show("b", 0, 4)
    ledgers.begin("c")  # the closed session's rows make room for an open one's
    for t in range(3):
        ledgers.record("c", step(t))
    assert ledgers.dropped == 2 and ledgers.nbytes <= ledgers.keep_bytes
