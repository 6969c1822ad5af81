"""Settings that pin a node's placement: what tests and benchmarks that count work or
compare tokens across layouts need (every run places the same way)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvasird.market.model import MarketModel
from kvasird.market.pinning import parse_hold
from kvasird.model.manifest import Manifest


def pinned(model: Path, pins: list[str], **extra: Any) -> dict[str, Any]:
    """A node that holds exactly ``pins`` of ``model``: a budget just big enough for them
    (every unit of the models used is over 1 MiB, so the budget's rounding slack can never
    enroll the node into anything else), fast heartbeats, one replica per unit."""
    mm = MarketModel.from_manifest(Manifest.from_gguf(model))
    held = {u for p in pins for u in parse_hold(p)}
    budget = math.ceil(sum(mm.size(u) for u in held) / 2**20) if held else 0
    return {
        "market.model": str(model),
        "market.hold": pins,
        "market.memory_budget_mb": budget,
        "market.heartbeat_s": 0.5,
        "market.rebalance_s": 2.0,
        "market.enroll_delay_s": 0.0,
        "market.target_replicas": 1,
        "compute.threads": 1,
        "inference.kv_slots": 1024,
        "inference.step_timeout_s": 10.0,
        **extra,
    }
