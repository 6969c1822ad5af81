"""Pay-per-inference end to end: a quote, a KVR transfer on the local chain, an answer."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest
import trio
from solders.keypair import Keypair

from kvasird.localnet import LocalNet
from kvasird.localnet.demo import SYSTEM, kvr_balance
from kvasird.model.bundled import bundled_path
from kvasird.settlement.consumer import (
    PAYMENT_HEADER,
    funded_wallet,
    get_quote,
    pay_quote,
    prepaid_header,
)
from kvasird.settlement.token import KVR_DECIMALS

pytestmark = pytest.mark.slow

KVR = 10**KVR_DECIMALS


def paid_gateway(localnet: Callable[..., LocalNet]) -> tuple[LocalNet, str, openai.OpenAI]:
    """One node on the local chain whose gateway charges even this machine."""
    net = localnet(1, chain=True, settings={
        "market.model": str(bundled_path()), "gateway.local": True,
        "settlement.free_local": False, "compute.threads": 1, "inference.serve": False})
    net.up()
    gateway = net.nodes[0].status()["gateway"]
    net.wait_until("the gateway is ready", lambda: httpx.get(f"{gateway}/health").status_code == 200,
                   timeout=60)
    return net, gateway, openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


def test_a_paid_request_is_answered_once_and_an_unpaid_one_refused(
        localnet: Callable[..., LocalNet]) -> None:
    net, gateway, client = paid_gateway(localnet)
    node = net.nodes[0]
    ask = {"model": client.models.list().data[0].id, "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "system", "content": SYSTEM},  # greedy: Paris, see SYSTEM
                        {"role": "user", "content": "What is the capital of France?"}]}

    with pytest.raises(openai.APIStatusError) as unpaid:
        client.chat.completions.create(**ask)
    assert unpaid.value.status_code == 402 and "/v1/kvasir/quote" in str(unpaid.value)

    rpc = net.chain.info["RPC URL"]  # type: ignore[union-attr]
    consumer = trio.run(funded_wallet, rpc, 100 * KVR)
    quote = get_quote(gateway, request=ask)  # the request itself: its prompt is counted
    assert int(quote["prompt_tokens"]) > 10 and quote["max_tokens"] == 8
    header = trio.run(pay_quote, rpc, consumer, quote)
    answer = client.chat.completions.create(**ask, extra_headers={PAYMENT_HEADER: header})
    assert "Paris" in answer.choices[0].message.content

    with pytest.raises(openai.APIStatusError) as reused:
        client.chat.completions.create(**ask, extra_headers={PAYMENT_HEADER: header})
    assert reused.value.status_code == 402 and "already been used" in str(reused.value)

    for too_small in (get_quote(gateway, 8), get_quote(gateway, 2, quote["prompt_tokens"])):
        # a quote for the output alone buys no prompt; one for fewer tokens, not this request
        small_header = trio.run(pay_quote, rpc, consumer, too_small)
        with pytest.raises(openai.APIStatusError) as short:
            client.chat.completions.create(**ask, extra_headers={PAYMENT_HEADER: small_header})
        assert short.value.status_code == 402 and "KVR more is needed" in str(short.value)
        assert f"covers {int(too_small['amount']) / KVR:.6f} KVR" in str(short.value)
    log = node.log.read_text()
    assert "paid request settled" in log


def test_what_a_shorter_answer_leaves_unused_pays_the_next_request(
        localnet: Callable[..., LocalNet]) -> None:
    net, gateway, client = paid_gateway(localnet)
    rpc = net.chain.info["RPC URL"]  # type: ignore[union-attr]
    consumer = trio.run(funded_wallet, rpc, 100 * KVR)
    long = {"model": client.models.list().data[0].id, "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},  # one sentence, then its end
                         {"role": "user", "content": "What is the capital of France?"}]}
    quote = get_quote(gateway, request=long)
    answer = client.chat.completions.create(
        **long, extra_headers={PAYMENT_HEADER: trio.run(pay_quote, rpc, consumer, quote)})
    assert answer.choices[0].finish_reason == "stop" and answer.usage is not None
    unused = (200 - answer.usage.completion_tokens) * int(quote["price_per_1k_output_tokens"])
    prepaid = int(httpx.get(f"{gateway}/v1/kvasir/balance/{consumer.pubkey()}").json()["prepaid"])
    assert abs(prepaid - unused / 1000) <= 1, (prepaid, unused)

    short = {**long, "max_tokens": 4}
    small = get_quote(gateway, request=short)
    assert int(small["amount"]) <= prepaid
    with pytest.raises(openai.APIStatusError) as forged:  # another wallet's signature
        client.chat.completions.create(**short, extra_headers={PAYMENT_HEADER: prepaid_header(
            consumer, small).replace(str(consumer.pubkey()), str(Keypair().pubkey()))})
    assert forged.value.status_code == 402 and "not" in str(forged.value)
    before = kvr_balance(net, consumer.pubkey())
    paid = client.chat.completions.create(
        **short, extra_headers={PAYMENT_HEADER: prepaid_header(consumer, small)})
    assert paid.choices[0].message.content
    assert kvr_balance(net, consumer.pubkey()) == before  # no transaction: the balance paid
    left = int(httpx.get(f"{gateway}/v1/kvasir/balance/{consumer.pubkey()}").json()["prepaid"])
    assert left == prepaid - int(small["amount"])
