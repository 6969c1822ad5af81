"""The gateway over the swarm generator (no local engine): the contract is all it uses.

A single daemon enrolls itself into every unit of the model, so the route is itself;
until then the gateway answers 503 with the API's own error, afterwards the same text
the engine gives with the whole model in one stage.
"""

from __future__ import annotations

import httpx
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from greedy import greedy  # type: ignore[import-not-found]

from kvasird.localnet.demo import SYSTEM
from kvasird.text.chat import Message
from tests.support import eventually

pytestmark = pytest.mark.slow

GATEWAY_SETTINGS = {"gateway.local": False}
ROUTE_S = 60.0

MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the capital of France?"}]
BODY = {"messages": MESSAGES, "temperature": 0, "max_tokens": 16}


def test_a_swarm_route_answers_like_the_local_engine(daemon: Daemon) -> None:
    def routed() -> httpx.Response | None:
        r = httpx.post(daemon.url + "/v1/chat/completions", json={"model": daemon.model, **BODY},
                       timeout=60)
        if r.status_code != 503:
            return r
        assert r.json()["error"]["code"] == "no_route"
        return None

    r = eventually("a route forms", routed, timeout=ROUTE_S, every=0.5,
                   context=lambda: "log:\n" + daemon.node.tail())
    assert r.status_code == 200, r.text
    answer = greedy([Message(**m) for m in MESSAGES], 16)
    assert r.json()["choices"][0]["message"]["content"] == answer.text
