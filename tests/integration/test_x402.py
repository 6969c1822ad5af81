"""An agent pays a paid 3-node network per request with x402: the official package's HTTP
client meets each 402, signs the payment, and the gateway settles it on the local chain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature
from test_money import gateway_of, paid_net
from x402 import x402Client
from x402.http.clients.httpx import x402HttpxClient
from x402.http.utils import (
    decode_payment_required_header,
    decode_payment_response_header,
    encode_payment_signature_header,
)
from x402.schemas import PaymentCreatedContext, PaymentRequired

from kvasird.localnet import LocalNet
from kvasird.localnet.demo import SYSTEM, kvr_balance
from kvasird.model.bundled import bundled_path
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.consumer import funded_wallet
from kvasird.settlement.token import token_account
from kvasird.settlement.x402 import ExactSvmClient, network_id

pytestmark = pytest.mark.slow

KVR = 10**6
REQUESTS = 10


def asks(model: str) -> list[tuple[str, dict[str, Any]]]:
    """Ten requests, in both APIs: what an agent's calls look like."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, *messages]}
    anthropic = {"model": model, "max_tokens": 8, "temperature": 0, "system": SYSTEM,
                 "messages": messages}
    return [("/v1/chat/completions", chat) if i % 2 == 0 else ("/v1/messages", anthropic)
            for i in range(REQUESTS)]


def reply(answer: dict[str, Any]) -> str:
    """The text of a chat completion or of an Anthropic message."""
    if "choices" in answer:
        return str(answer["choices"][0]["message"]["content"])
    return "".join(b.get("text", "") for b in answer["content"])


async def pay_per_request(url: str, rpc: str, wallet: Keypair, model: str
                          ) -> tuple[list[httpx.Response], list[str]]:
    """Each request sent as an agent sends it: no payment, then the x402 client pays its 402.
    Returns the answers and every PAYMENT-SIGNATURE the client made."""
    async with ChainClient(rpc) as chain:
        network = network_id(await chain.genesis_hash())
        mint = (await chain.local_chain_keys()).mint
    client = x402Client()
    client.register(network, ExactSvmClient(wallet, rpc))
    client.set_spend_controls({"allowed_assets": [
        {"network": network, "asset": str(mint), "max_amount_per_payment": str(KVR)}]})
    signatures: list[str] = []

    def made(ctx: PaymentCreatedContext) -> None:
        signatures.append(encode_payment_signature_header(ctx.payment_payload))

    client.on_after_payment_creation(made)
    async with x402HttpxClient(client, base_url=url, timeout=120) as http:
        answers = [await http.post(path, json=body) for path, body in asks(model)]
    return answers, signatures


async def landed(rpc: str, signatures: list[str]) -> list[Any]:
    """The chain's own record of each transaction."""
    async with ChainClient(rpc) as chain:
        return [await chain.transaction(Signature.from_string(s)) for s in signatures]


def test_an_x402_client_pays_a_three_node_network_per_request(
        localnet: Callable[..., LocalNet]) -> None:
    net = paid_net(localnet, bundled_path(),
                   [["head", "layers:0-10"], ["layers:10-20"], ["layers:20-30"]],
                   **{"inference.step_timeout_s": 3.0})
    assert net.chain is not None
    gateway = net.nodes[0]
    url, client = gateway_of(net, gateway)
    rpc, vault = net.chain.info["RPC URL"], gateway.wallet()
    mint = Pubkey.from_string(net.chain.info["KVR mint"])
    model = client.models.list().data[0].id

    unpaid = httpx.post(f"{url}/v1/chat/completions", json=asks(model)[0][1], timeout=60)
    assert unpaid.status_code == 402 and "/v1/kvasir/quote" in unpaid.text  # both ways to pay
    offer = decode_payment_required_header(unpaid.headers["PAYMENT-REQUIRED"])
    assert isinstance(offer, PaymentRequired)
    assert [(a.scheme, a.asset, a.pay_to) for a in offer.accepts] == [
        ("exact", str(mint), str(vault))]

    wallet = trio.run(funded_wallet, rpc, 100 * KVR)
    before = kvr_balance(net, wallet.pubkey())
    vault_before = kvr_balance(net, vault)
    answers, signatures = trio.run(pay_per_request, url, rpc, wallet, model)
    assert [a.status_code for a in answers] == [200] * REQUESTS, [a.text for a in answers]
    assert len(signatures) == REQUESTS  # one payment a request
    assert all(reply(a.json()) for a in answers), [a.text for a in answers]
    settled = [decode_payment_response_header(a.headers["PAYMENT-RESPONSE"]) for a in answers]
    assert all(s.success and s.payer == str(wallet.pubkey()) for s in settled)

    txs = trio.run(landed, rpc, [s.transaction for s in settled])  # read the chain itself
    paid = 0
    for s, tx in zip(settled, txs, strict=True):
        assert tx is not None and tx.error is None, s.transaction
        moved = {d.account: d.change for d in tx.token_deltas if d.mint == mint}
        assert moved[token_account(vault, mint)] == int(s.amount) > 0
        assert moved[token_account(wallet.pubkey(), mint)] == -int(s.amount)
        assert tx.fee_payer == vault  # the gateway co-signed and paid the fee
        paid += int(s.amount)
    assert kvr_balance(net, wallet.pubkey()) == before - paid
    assert kvr_balance(net, vault) == vault_before + paid
    ended = [a for a in answers if a.json().get("stop_reason") == "end_turn"]
    assert ended, [a.text for a in answers]  # shorter than max_tokens: they left tokens unused
    prepaid = int(httpx.get(f"{url}/v1/kvasir/balance/{wallet.pubkey()}").json()["prepaid"])
    assert 0 < prepaid < paid  # credited to the payer here, as for X-Kvasir-Payment

    path, body = asks(model)[-1]
    replayed = httpx.post(f"{url}{path}", json=body, timeout=60,
                          headers={"PAYMENT-SIGNATURE": signatures[-1]})
    assert replayed.status_code == 402 and "already been used" in replayed.text, replayed.text
    again = decode_payment_required_header(replayed.headers["PAYMENT-REQUIRED"])
    assert again.error is not None and "already been used" in again.error
    assert kvr_balance(net, wallet.pubkey()) == before - paid  # nothing moved
    assert "paid request settled" in gateway.log.read_text()
