"""The demo on a local network: a model split among the nodes by the market, and a paid prompt.

    serve_model   node 0 imports the model and seeds it; every node enrolls into a share of it
                  (the market decides who holds what); the shares are downloaded from node 0
    ask           a consumer wallet funded by the local faucet gets a quote, pays it on the
                  local chain, and asks the gateway through the official OpenAI client
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from kvasird.localnet.launcher import LocalNet, LocalNetError
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from kvasird.settlement.consumer import PAYMENT_HEADER, funded_wallet, get_quote, pay_quote
from kvasird.settlement.token import KVR_DECIMALS

SYSTEM = "You are a helpful assistant."


def model_path(ref: str) -> Path:
    return bundled_path() if ref == "bundled:smollm2" else Path(ref).expanduser().resolve()


def serve_model(net: LocalNet, ref: str) -> Manifest:
    """Configure the nodes so that the market splits the model among them (call before up)."""
    path = model_path(ref)
    manifest = Manifest.from_gguf(path)
    n = len(net.nodes)
    # Each node may hold a bit more than its share: together they cover the model once,
    # and the market, not this function, decides which node holds which units.
    budget_mb = int(manifest.total_bytes * 1.35 / n / 2**20) + 1
    net.settings.update({"market.memory_budget_mb": budget_mb, "market.target_replicas": 1,
                         "market.heartbeat_s": 1.0, "market.rebalance_s": 2.0,
                         "market.enroll_delay_s": 1.0, "compute.threads": 1})
    for node in net.nodes:
        node.settings["market.model"] = str(path) if node.index == 0 else manifest.model_id
    return manifest


def wait_served(net: LocalNet, timeout: float = 240.0) -> str:
    """Wait until the market covers the model and node 0's gateway answers; its URL."""
    first = net.nodes[0]
    net.wait_until("every unit of the model is online on some node",
                   lambda: first.get("/v0/coverage")["routable"], timeout=timeout)
    url = first.status()["gateway"]
    net.wait_until("the gateway on node 0 is ready",
                   lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200,
                   timeout=timeout)
    return url


@dataclass(frozen=True)
class Answer:
    text: str
    """The model's reply."""
    paid: int
    """KVR base units paid for it."""
    signature: str
    """The payment's transaction signature on the local chain."""
    seconds: float
    """Wall time of the request (after payment)."""
    model: str
    """The model id the gateway served it with."""


def ask(net: LocalNet, gateway: str, question: str, max_tokens: int = 24) -> Answer:
    import openai  # deferred: only the demo needs the client

    if net.chain is None:
        raise LocalNetError("the demo pays on the local chain: start the network with a chain")
    rpc = net.chain.info["RPC URL"]
    consumer = trio.run(funded_wallet, rpc, 100 * 10**KVR_DECIMALS)
    quote = get_quote(gateway, max_tokens)
    header = trio.run(pay_quote, rpc, consumer, quote)
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="paid-per-request", max_retries=0)
    model = client.models.list().data[0].id
    began = time.monotonic()
    reply = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_headers={PAYMENT_HEADER: header})
    return Answer(reply.choices[0].message.content or "", int(quote["amount"]),
                  header.split(":", 1)[1], time.monotonic() - began, model)
