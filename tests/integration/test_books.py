"""The market's books balance, seen from outside: the operator's own requests are paid to the
peers from its wallet and never cut off, and the peers meter what they compute."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest
import trio

from kvasird.localnet import LocalNet
from kvasird.localnet.demo import claim_all, earnings, kvr_balance, serve_model, wait_served
from kvasird.model.bundled import bundled_path
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.pricing import GENESIS_STAKE_MIN

pytestmark = pytest.mark.slow

REQUESTS = 100
"""Local requests in a row: 20 times what cut the gateway off before the peers metered work."""


def test_the_operators_own_requests_pay_the_peers_and_are_never_cut_off(
        localnet: Callable[..., LocalNet]) -> None:
    net = localnet(3, chain=True)  # as `kvasird localnet up` builds it
    serve_model(net, bundled_path())
    net.up()
    url = wait_served(net)
    gateway = net.nodes[0]
    vault = kvr_balance(net, gateway.wallet())
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    ask = {"model": model, "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "user", "content": "Name a colour."}]}
    for i in range(REQUESTS):  # from this machine, no payment: the operator pays
        if i % 2:
            with client.chat.completions.with_streaming_response.create(**ask, stream=True) as r:
                assert r.headers["x-kvasir-paid-by"] == f"operator {gateway.wallet()}"
                assert sum(1 for _ in r.iter_lines()) > 2
        else:
            raw = client.chat.completions.with_raw_response.create(**ask)
            assert raw.headers["x-kvasir-paid-by"] == f"operator {gateway.wallet()}"
            assert raw.parse().choices[0].message.content
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["status"] == "ok", health
    generated = httpx.post(gateway.home.admin_address() + "/v0/generate",  # kvasird generate
                           json={"prompt": [1, 2, 3, 4], "max_tokens": 4}, timeout=120)
    assert generated.status_code == 200 and '"token"' in generated.text, generated.text

    earned = {e.index: e.earned for e in earnings(net)}  # every receipt delivered
    wallet = gateway.get("/v0/wallet")
    assert wallet["own_use"]["requests"] == REQUESTS + 1  # the admin API's generation too
    assert earned[1] > 0 and earned[2] > 0
    spent = wallet["own_use"]["spent"]
    pools = wallet["pools"]
    assert spent == sum(earned.values()) + pools["operator"] + pools["insurance"]

    paid = {p.index: p.amount for p in claim_all(net)}
    assert paid[1] == earned[1] and paid[2] == earned[2] and paid[0] == 0
    assert kvr_balance(net, gateway.wallet()) == vault - paid[1] - paid[2]  # to the base unit


def test_the_operator_is_told_how_to_top_up_when_its_wallet_cannot_pay(
        localnet: Callable[..., LocalNet]) -> None:
    net = localnet(1, chain=True, settings={
        "market.model": str(bundled_path()), "gateway.local": True, "compute.threads": 1,
        "inference.serve": False})
    gateway = net.nodes[0]
    gateway.stake = GENESIS_STAKE_MIN  # the stake and nothing to spend above it
    net.up()
    url = gateway.status()["gateway"]
    net.wait_until("the gateway is ready",
                   lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 60)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
    ask = {"model": client.models.list().data[0].id, "max_tokens": 8,
           "messages": [{"role": "user", "content": "Name a colour."}]}
    with pytest.raises(openai.APIStatusError) as short:
        client.chat.completions.create(**ask)
    assert short.value.status_code == 402, short.value
    assert f"send KVR to {gateway.wallet()} to top it up" in str(short.value)
    assert net.chain is not None
    rpc = net.chain.info["RPC URL"]

    async def top_up() -> None:
        async with ChainClient(rpc, "confirmed") as chain:
            await chain.faucet(gateway.wallet(), kvr=10**6)  # 1 KVR
    trio.run(top_up)
    assert client.chat.completions.create(**ask).choices[0].message.content
