"""A paid request for n choices pays for n generations, and a paid tool call is served within
its quote (a real daemon on the local chain)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from kvasird.localnet import LocalNet
from kvasird.model.bundled import bundled_path
from kvasird.settlement.consumer import PAYMENT_HEADER, funded_wallet, get_quote, pay_quote
from tests.support import eventually

pytestmark = pytest.mark.slow

KVR = 10**6
READY_S = 120.0


@pytest.fixture(scope="module")
def paid(module_tmp: Callable[[str], Path]) -> Iterator[tuple[LocalNet, str]]:
    """A one-node network on the local chain whose gateway charges even this machine."""
    net = LocalNet(module_tmp("paid"), 1, chain=True, settings={
        "market.model": str(bundled_path()), "market.memory_budget_mb": 200,
        "market.target_replicas": 1, "market.heartbeat_s": 1.0, "market.enroll_delay_s": 0.0,
        "compute.threads": 1, "gateway.local": True, "settlement.free_local": False})
    try:
        net.up()
        url = net.nodes[0].status()["gateway"]
        eventually("the gateway is ready",
                   lambda: httpx.get(url + "/health", timeout=5).status_code == 200,
                   timeout=READY_S, every=0.2, context=net.nodes[0].tail)
        yield net, url
    finally:
        net.down()


def body(model: str, n: int) -> dict[str, Any]:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "n": n,
            "temperature": 1.0, "seed": 2}


def ask(url: str, model: str, header: str, n: int) -> Any:
    with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60) as c:
        return c.completions.create(**body(model, n), extra_headers={PAYMENT_HEADER: header})


def test_n_choices_need_a_quote_for_n_generations(paid: tuple[LocalNet, str]) -> None:
    """Each choice computes the prompt and its own tokens: a quote for the request's body
    counts both n times."""
    net, url = paid
    assert net.chain is not None
    rpc = net.chain.info["RPC URL"]
    wallet = trio.run(funded_wallet, rpc, 100 * KVR)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    one, three = get_quote(url, request=body(model, 1)), get_quote(url, request=body(model, 3))
    assert three["max_tokens"] == 12 and three["prompt_tokens"] == 3 * one["prompt_tokens"] > 0
    assert three["amount"] == get_quote(url, 12, three["prompt_tokens"])["amount"]
    with pytest.raises(openai.APIStatusError) as info:
        ask(url, model, trio.run(pay_quote, rpc, wallet, one), 3)
    assert info.value.status_code == 402
    message = info.value.body["message"]  # type: ignore[index]
    assert "12 output tokens (3 choices of up to 4)" in message and "more is needed" in message
    r = ask(url, model, trio.run(pay_quote, rpc, wallet, three), 3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage is not None and r.usage.completion_tokens <= 12


def test_a_paid_tool_call_is_served_within_its_quote(paid: tuple[LocalNet, str]) -> None:
    """A forced tool call is generation like any other: its tokens are within the quote and
    counted in usage (and so in the work split among the peers that computed them)."""
    net, url = paid
    assert net.chain is not None
    rpc = net.chain.info["RPC URL"]
    wallet = trio.run(funded_wallet, rpc, 100 * KVR)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}}]
    request = {"model": model, "messages": [{"role": "user", "content": "?"}], "tools": tools,
               "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60,
               "temperature": 0}
    quote = get_quote(url, request=request)  # the tools' definitions are part of the prompt
    assert quote["prompt_tokens"] > 20
    header = trio.run(pay_quote, rpc, wallet, quote)
    with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60) as c:
        with pytest.raises(openai.APIStatusError) as info:  # tools do not widen the quote
            c.chat.completions.create(**{**request, "max_tokens": 61},
                                      extra_headers={PAYMENT_HEADER: header})
        assert info.value.status_code == 402
        r = c.chat.completions.create(**request, extra_headers={PAYMENT_HEADER: header})
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    assert r.usage is not None and 0 < r.usage.completion_tokens < 60
