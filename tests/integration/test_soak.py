"""The churn soak, short: bench/soak.py runs it five minutes (kvasird_dev.soak)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvasird.model.bundled import bundled_path
from kvasird_dev.soak import Soak

pytestmark = pytest.mark.slow


def test_kills_restarts_and_a_slowed_node_leave_every_output_exact(tmp_path: Path) -> None:
    """Four daemons with two replicas of every layer, two clients for 50 s: one node is
    slowed from 5 s to 20 s, then at 25 s a serving node is SIGKILLed and started again.
    The gateway retries (the clients never do): nearly every request completes, and every
    completed greedy output is the undisturbed one, token for token."""
    soak = Soak(tmp_path, bundled_path(), duration_s=50, kill_every_s=25, clients=2,
                degrade_at_s=5, degrade_s=15)
    report = soak.run()
    s = report.summary()
    print(s, *report.log, sep="\n")
    assert s["kills"] >= 1 and s["requests"] >= 10
    assert any(" restarted in " in line for line in report.log), report.log
    assert s["equal"] == s["completed"], "a completed output differs from the undisturbed one"
    assert s["completed_pct"] >= 90, s
