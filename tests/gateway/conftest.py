"""One real daemon per test module, holding the bundled model, its gateway on a free port.

A module may set ``GATEWAY_SETTINGS`` (config keys) to change its daemon's limits.
ggml runs with one thread: on a shared 2-core machine two spinning threads stall
each other (STACK.md), and one thread decodes the bundled model at ~80 tokens/s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvasird.inference.tokenizer import Tokenizer
from kvasird.localnet import LocalNet
from kvasird.model.bundled import bundled_path

READY_S = 60.0

sys.path.insert(0, str(Path(__file__).parent))
from gateway_daemon import Daemon  # noqa: E402


@pytest.fixture(scope="module")
def daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Daemon]:
    settings = {"market.model": str(bundled_path()), "market.memory_budget_mb": 200,
                "market.target_replicas": 1, "market.heartbeat_s": 1.0,
                "market.enroll_delay_s": 0.0, "compute.threads": 1, "gateway.local": True,
                **getattr(request.module, "GATEWAY_SETTINGS", {})}
    net = LocalNet(tmp_path_factory.mktemp("gateway"), 1, settings=settings)
    try:
        net.up()
        node = net.nodes[0]
        url = node.status()["gateway"]
        deadline = time.monotonic() + READY_S
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, f"gateway not ready; log:\n{node.tail()}"
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        yield Daemon(node, url, model, Tokenizer.from_gguf(bundled_path()))
    finally:
        net.down()
