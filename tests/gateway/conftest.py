"""Real daemons holding the bundled model, their gateways on free ports.

A module may set ``GATEWAY_SETTINGS`` (config keys) to change its daemon's limits. Modules
with the same settings share one daemon (their tests compare counts with what they read
before, never with zero), so each setting starts one daemon, not each module.

ggml runs with one thread: on a shared 2-core machine two spinning threads stall
each other (STACK.md), and one thread decodes the bundled model at ~80 tokens/s.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasird.localnet import LocalNet
from kvasird.model.bundled import bundled_path
from kvasird.text.tokenizer import Tokenizer
from tests.support import eventually

READY_S = 60.0

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from gateway_daemon import Daemon  # noqa: E402


class SharedDaemons:
    """The run's gateway daemons, one per settings, each started on first use.

    Each holds ~0.8 GB, so all are stopped as soon as the run leaves this folder (a test
    here that comes later again starts its daemon anew), and their homes removed while no
    test of the run has failed (as ``module_tmp``'s)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, session: pytest.Session
                 ) -> None:
        self._tmp = tmp_path_factory
        self._session = session
        self._running: dict[str, tuple[LocalNet, Daemon]] = {}

    def daemon_for(self, settings: dict[str, Any]) -> Daemon:
        key = json.dumps(settings, sort_keys=True)
        if key not in self._running:
            net = LocalNet(self._tmp.mktemp("gateway"), 1, settings=settings)
            try:
                self._running[key] = (net, serving(net))
            except BaseException:
                net.down()
                raise
        return self._running[key][1]

    def stop_all(self) -> None:
        while self._running:
            net, _ = self._running.popitem()[1]
            net.down()
            if not self._session.testsfailed:
                shutil.rmtree(net.root, ignore_errors=True)


SHARED = pytest.StashKey[SharedDaemons]()


@pytest.fixture(scope="session")
def gateway_daemons(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[Callable[[dict[str, Any]], Daemon]]:
    """``gateway_daemons(settings)``: the running daemon with these settings."""
    shared = request.config.stash[SHARED] = SharedDaemons(tmp_path_factory, request.session)
    yield shared.daemon_for
    shared.stop_all()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    if nextitem is None or HERE not in nextitem.path.parents:
        shared = item.config.stash.get(SHARED, None)
        if shared is not None:
            shared.stop_all()


def serving(net: LocalNet) -> Daemon:
    """Start `net`'s one node and wait until its gateway answers."""
    net.up()
    node = net.nodes[0]
    url = node.status()["gateway"]
    eventually("the gateway is ready", lambda: httpx.get(url + "/health").status_code == 200,
               timeout=READY_S, context=node.tail)
    model = httpx.get(url + "/v1/models").json()["data"][0]["model_id"]
    return Daemon(node, url, model, Tokenizer.from_gguf(bundled_path()))


@pytest.fixture(scope="module")
def daemon(request: pytest.FixtureRequest,
           gateway_daemons: Callable[[dict[str, Any]], Daemon]) -> Daemon:
    return gateway_daemons({
        "market.model": str(bundled_path()), "market.memory_budget_mb": 200,
        "market.target_replicas": 1, "market.heartbeat_s": 1.0, "market.enroll_delay_s": 0.0,
        "compute.threads": 1, "gateway.local": True,
        **getattr(request.module, "GATEWAY_SETTINGS", {})})
