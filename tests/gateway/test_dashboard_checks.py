"""The dashboard's spot-check card: what was checked, who was caught, what nobody checks."""

from __future__ import annotations

import numpy as np

from kvasird.gateway.dashboard import _checks
from kvasird.inference.client.spotcheck import SpotChecks


def test_the_card_names_the_units_nobody_else_holds_and_the_peers_caught() -> None:
    spot = SpotChecks(0.1, 0.05, 1e-3)
    spot.stages.checked = 7
    spot.nobody(spot.stages, "layers 20-29")
    spot.nobody(spot.stages, "layers 20-29")
    rows = np.ones((2, 4), np.float32)
    spot.caught("stage", "12D3KooWLiar", "layers 10-19", ["12D3KooWOther"], rows, rows * 2,
                rows, 1.0)
    card = _checks({"checks": spot.status()})
    assert "<th>stage sessions</th><td>7 checked, 1 caught (10% drawn, a cheat caught " \
        "within 29 (95 %))</td>" in card
    assert "Drawn but not checkable: layers 20-29 ×2." in card
    spot.decode.checked, spot.decode.unshown = 3, 2
    assert "<th>later steps</th><td>3 checked, 0 caught, 2 hop-sessions unpaid: could not " \
        "show their work</td>" in _checks({"checks": spot.status()})
    assert "layers 10-19" in card
    assert "not checkable" not in _checks({"checks": SpotChecks(0.1, 0.05, 1e-3).status()})
    assert "without a node" in _checks({})
