"""Pay-per-inference end to end: a quote, a KVR transfer on the local chain, an answer."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest
import trio

from kvasird.localnet import LocalNet
from kvasird.localnet.demo import SYSTEM
from kvasird.model.bundled import bundled_path
from kvasird.settlement.consumer import PAYMENT_HEADER, funded_wallet, get_quote, pay_quote
from kvasird.settlement.token import KVR_DECIMALS

pytestmark = pytest.mark.slow

KVR = 10**KVR_DECIMALS


def test_a_paid_request_is_answered_once_and_an_unpaid_one_refused(
        localnet: Callable[..., LocalNet]) -> None:
    net = localnet(1, chain=True, settings={
        "market.model": str(bundled_path()), "gateway.local": True,
        "settlement.free_local": False, "compute.threads": 1, "inference.serve": False})
    net.up()
    node = net.nodes[0]
    gateway = node.status()["gateway"]
    net.wait_until("the gateway is ready", lambda: httpx.get(f"{gateway}/health").status_code == 200,
                   timeout=60)
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    ask = {"model": client.models.list().data[0].id, "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "system", "content": SYSTEM},  # greedy: Paris, see SYSTEM
                        {"role": "user", "content": "What is the capital of France?"}]}

    with pytest.raises(openai.APIStatusError) as unpaid:
        client.chat.completions.create(**ask)
    assert unpaid.value.status_code == 402 and "/v1/kvasir/quote" in str(unpaid.value)

    rpc = net.chain.info["RPC URL"]  # type: ignore[union-attr]
    consumer = trio.run(funded_wallet, rpc, 100 * KVR)
    quote = get_quote(gateway, 8)
    header = trio.run(pay_quote, rpc, consumer, quote)
    answer = client.chat.completions.create(**ask, extra_headers={PAYMENT_HEADER: header})
    assert "Paris" in answer.choices[0].message.content

    with pytest.raises(openai.APIStatusError) as reused:
        client.chat.completions.create(**ask, extra_headers={PAYMENT_HEADER: header})
    assert reused.value.status_code == 402 and "already been used" in str(reused.value)

    too_small = get_quote(gateway, 2)
    small_header = trio.run(pay_quote, rpc, consumer, too_small)
    with pytest.raises(openai.APIStatusError) as short:
        client.chat.completions.create(**ask, extra_headers={PAYMENT_HEADER: small_header})
    assert short.value.status_code == 402 and "covers 2 tokens" in str(short.value)
    log = node.log.read_text()
    assert "paid request settled" in log
