"""The gateway over the swarm generator (no local engine): the contract is all it uses.

A single daemon enrolls itself into every unit of the model, so the route is itself;
until then the gateway answers 503 with the API's own error, afterwards the same text
the local generator gives.
"""

from __future__ import annotations

import time

import httpx
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]

pytestmark = pytest.mark.slow

GATEWAY_SETTINGS = {"gateway.local": False}
ROUTE_S = 60.0

BODY = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 16}


def test_a_swarm_route_answers_like_the_local_engine(daemon: Daemon) -> None:
    deadline = time.monotonic() + ROUTE_S
    while True:
        r = httpx.post(daemon.url + "/v1/chat/completions", json={"model": daemon.model, **BODY},
                       timeout=60)
        if r.status_code != 503:
            break
        assert r.json()["error"]["code"] == "no_route"
        assert time.monotonic() < deadline, "no route formed; log:\n" + daemon.node.tail()
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
