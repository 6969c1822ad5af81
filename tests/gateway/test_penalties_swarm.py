"""Penalties and a logit bias over the swarm generator: they travel to the head in the
stage protocol's sampling map, and the routed answer is the engine's under them."""

from __future__ import annotations

import httpx
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from greedy import greedy  # type: ignore[import-not-found]

from kvasird.compute.sampling import SamplingParams
from kvasird.text.chat import Message
from tests.support import eventually

pytestmark = pytest.mark.slow

GATEWAY_SETTINGS = {"gateway.local": False}
"""As test_swarm_gateway: one daemon enrolled in every unit, its route itself."""
ROUTE_S = 60.0

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_routed_answer_follows_the_penalties_and_bias_asked_for(daemon: Daemon) -> None:
    messages = [Message(**m) for m in MESSAGES]
    first = daemon.tokenizer.encode(greedy(messages, 12).text)[0]
    params = SamplingParams(frequency_penalty=1.2, presence_penalty=0.7, penalty_last_n=32,
                            logit_bias=((first, -100.0),))
    body = {"model": daemon.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 12,
            "frequency_penalty": 1.2, "presence_penalty": 0.7, "repeat_last_n": 32,
            "logit_bias": {str(first): -100}}

    def routed() -> httpx.Response | None:
        r = httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=60)
        return None if r.status_code == 503 else r

    r = eventually("a route forms", routed, timeout=ROUTE_S, every=0.5,
                   context=lambda: "log:\n" + daemon.node.tail())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == greedy(messages, 12, params).text
