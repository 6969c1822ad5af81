"""Takes sized by the node's measured download rate: the moving average, the take's floor
and cap, and the herd guard and round budget built on it."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.market.coverage import Counts
from kvasird.market.demand import Demand
from kvasird.market.model import MarketModel
from kvasird.market.pacing import (
    DEFAULT_RATE,
    TAKE_S,
    Bandwidth,
    joins_round,
    round_budget,
    take_bytes,
)

MB = 10**6
GB = 10**9


@pytest.fixture
def big() -> MarketModel:
    """4 layers x 8 experts: layers 200 MB, experts 5 MB, head 1 GB (the largest unit)."""
    return MarketModel.uniform("ab" * 32, 4, 8, layer_bytes=200 * MB, expert_bytes=5 * MB,
                               head_bytes=GB)


def test_the_first_measured_download_replaces_the_default_and_later_ones_move_the_average(
        ) -> None:
    bw = Bandwidth()
    assert bw.rate == DEFAULT_RATE and bw.measured == 0
    bw.observe(400 * MB, 10.0)
    assert bw.rate == pytest.approx(40 * MB)
    bw.observe(100 * MB, 10.0)
    assert bw.rate == pytest.approx(25 * MB)  # halfway to 10 MB/s


def test_downloads_too_short_to_measure_leave_the_rate_alone() -> None:
    bw = Bandwidth()
    bw.observe(10_000, 0.05)  # round trips, not bandwidth
    bw.observe(0, 30.0)  # everything was resumed from disk
    assert bw.rate == DEFAULT_RATE and bw.measured == 0


def test_the_take_grows_with_the_measured_rate(big: MarketModel) -> None:
    slow, fast = Bandwidth(), Bandwidth()
    slow.observe(100 * MB, 20.0)  # 5 MB/s
    fast.observe(2 * GB, 20.0)  # 100 MB/s
    assert take_bytes(big, 64 * GB, fast.rate) == int(TAKE_S * 100 * MB)
    assert take_bytes(big, 64 * GB, fast.rate) > take_bytes(big, 64 * GB, DEFAULT_RATE)


def test_the_take_is_at_least_the_largest_unit_and_at_most_the_budget(big: MarketModel) -> None:
    assert take_bytes(big, 64 * GB, 1 * MB) == GB  # 30 MB in 30 s: the head still fits
    assert take_bytes(big, 300 * MB, 100 * MB) == 300 * MB
    assert round_budget(big, 10 * GB, 2 * GB, 100 * MB) == 2 * GB + int(TAKE_S * 100 * MB)
    assert round_budget(big, 10 * GB, 9 * GB, 100 * MB) == 10 * GB


def test_a_faster_node_joins_fewer_rounds_for_the_same_deficit(big: MarketModel) -> None:
    """p = max(1, missing / take) x rebalance / (participants x heartbeat): a deficit many
    takes large draws as many bytes, so fewer of the nodes that take more."""
    empty = Counts.zeros(big)
    targets = Demand(big).targets(20)  # all of it missing: 20 x 1.96 GB
    rng = np.random.default_rng(0)

    def joined(rate: float) -> int:
        return sum(joins_round(big, empty, targets, 10_000, 64 * GB, rate, 15.0, 5.0, rng)
                   for _ in range(20_000))

    slow, fast = joined(40 * MB), joined(400 * MB)  # takes of 1.2 and 12 GB
    assert slow > 5 * fast > 0
