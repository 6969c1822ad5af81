from __future__ import annotations

import pytest

from kvasird.market.model import MarketModel

MODEL_ID = "ab" * 32


@pytest.fixture
def model() -> MarketModel:
    """4 layers x 8 experts: layer 100 B, expert 10 B, head 50 B (total 1,050 B)."""
    return MarketModel.uniform(MODEL_ID, 4, 8, layer_bytes=100, expert_bytes=10, head_bytes=50)
