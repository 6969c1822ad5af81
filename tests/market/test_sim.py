"""The simulator: a couple of hundred virtual nodes running the real market code."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.market.model import MarketModel
from kvasird.model.manifest import HEAD, Unit
from kvasird_dev.marketsim import MB, MarketSim, SimConfig, SimResult

MODEL_ID = "cd" * 32


@pytest.fixture(scope="module")
def small_model() -> MarketModel:
    """8 layers x 32 experts of 10 MB, dense paths of 50 MB, head 200 MB: 3.2 GB."""
    return MarketModel.uniform(MODEL_ID, 8, 32, layer_bytes=50 * MB, expert_bytes=10 * MB,
                               head_bytes=200 * MB)


@pytest.fixture(scope="module")
def ran(small_model: MarketModel) -> tuple[MarketSim, SimResult]:
    """200 nodes with budgets of ~100 MB (about 3x what the targets need), skewed load."""
    config = SimConfig(nodes=200, duration_s=600, seed=7, boot_s=30, budget_median=100 * MB,
                       budget_sigma=0.5, budget_max=1000 * MB, skew=1.2, load_interval_s=20,
                       churn=0.01, churn_every_s=300)
    sim = MarketSim(config, small_model)
    return sim, sim.run()


def test_two_hundred_nodes_reach_full_coverage_within_their_budgets(
        ran: tuple[MarketSim, SimResult]) -> None:
    _, r = ran
    assert r.t_covered is not None and r.t_covered < 120
    assert r.samples[-1].covered == 1.0
    assert r.rejected == 0
    assert r.over_budget == 0
    assert r.expert_replicas.min() >= 2 and r.layer_replicas.min() >= 2 and r.head_replicas >= 2


def test_hot_experts_end_with_more_replicas_than_cold_ones(
        ran: tuple[MarketSim, SimResult]) -> None:
    sim, r = ran
    hot = r.expert_targets > sim.cfg.target_replicas
    assert hot.any() and (~hot).any()
    assert r.expert_replicas[hot].mean() > r.expert_replicas[~hot].mean() + 1
    assert (r.expert_replicas >= r.expert_targets).all()


def test_holder_index_answers_like_the_coverage_map(ran: tuple[MarketSim, SimResult]) -> None:
    sim, _ = ran
    rng = np.random.default_rng(0)
    units = [HEAD] + [Unit("layer", int(i)) for i in rng.integers(0, 8, 4)]
    units += [Unit("expert", int(i), int(e)) for i, e in rng.integers(0, [8, 32], (20, 2))]
    for unit in units:
        assert sorted(sim.index(unit)) == sorted(sim.truth.holders(unit))


def test_gossip_bytes_come_from_real_record_encodings(ran: tuple[MarketSim, SimResult]) -> None:
    sim, r = ran
    g = r.gossip
    assert 150 < g.record_bytes < 4000
    assert 150 < g.envelope_bytes < 300
    # on change and keep-alives: a small fraction of one record per node and heartbeat
    assert 0 < g.records_per_min < 0.1 * 200 * 60 / sim.cfg.heartbeat_s
    degree = np.mean([n.degree for n in sim.nodes])
    assert sim.cfg.mesh_degree <= degree <= sim.cfg.mesh_degree_high
    assert g.mesh_per_node_min == pytest.approx((degree - 1) * g.unique_per_node_min)
    assert g.ihave_per_node_min > 0 and g.p99_per_node_min >= g.total_per_node_min


def test_nodes_size_their_takes_by_the_rate_their_downloads_measured(
        ran: tuple[MarketSim, SimResult]) -> None:
    sim, _ = ran
    downloaded = [n for n in sim.nodes if n.measured.measured]
    assert len(downloaded) > 20
    for n in downloaded:  # every simulated download runs at the node's drawn rate
        assert n.measured.rate == pytest.approx(n.bandwidth)
