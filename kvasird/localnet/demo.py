"""The demo on a local network: a model split among the nodes by the market, and a paid prompt.

serve_model   node 0 imports the model and seeds it; every node enrolls into a share of it
              (the market decides who holds what); the shares are downloaded from node 0
ask           a consumer wallet funded by the local faucet gets a quote, pays it on the
              local chain, and asks the gateway through the official OpenAI client
earnings      what each node earned for it, once the gateway's receipts have arrived
claim_all     every node claims; the payouts land on the local chain
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import trio
from solders.pubkey import Pubkey

from kvasird.compute import arch as archs
from kvasird.localnet.launcher import LocalNet, LocalNetError, LocalNode
from kvasird.model.manifest import Manifest
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.consumer import PAYMENT_HEADER, funded_wallet, get_quote, pay_quote
from kvasird.settlement.token import KVR_DECIMALS

if TYPE_CHECKING:
    from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming

SYSTEM = "Always answer in one short English sentence."
"""With it the bundled model's greedy answer to the default question is "The capital of
France is Paris.", each token up to "Paris" ahead of the next best by 2 logits or more
(the engine and the float64 oracles differ by at most 0.4 on these margins). After "You
are a helpful assistant." the first token led by 0.13: the CPU's rounding picked French."""


def serve_model(net: LocalNet, path: Path) -> Manifest:
    """Configure the nodes so that the market splits the GGUF at ``path`` among them (call
    before up). A file the engine cannot serve is refused here, in seconds, with what is
    supported (not after the wait for coverage)."""
    archs.check_file(path)
    manifest = Manifest.from_gguf(path)
    n = len(net.nodes)
    # Each node may hold a bit more than its share: together they cover the model once,
    # and the market, not this function, decides which node holds which units. The
    # largest unit (the head, with a large vocabulary) must fit one node's budget.
    largest = max(manifest.unit_sizes.values())
    budget_mb = int(max(manifest.total_bytes * 1.35 / n, largest * 1.05) / 2**20) + 1
    net.settings.update(
        {
            "market.memory_budget_mb": budget_mb,
            "market.target_replicas": 1,
            "market.heartbeat_s": 1.0,
            "market.rebalance_s": 2.0,
            "market.enroll_delay_s": 1.0,
            "compute.threads": 1,
        }
    )
    for node in net.nodes:
        node.settings["market.model"] = str(path) if node.index == 0 else manifest.model_id
    return manifest


def wait_served(net: LocalNet, timeout: float = 240.0) -> str:
    """Wait until the market covers the model and node 0's gateway answers; its URL."""
    first = net.nodes[0]
    net.wait_until(
        "every unit of the model is online on some node",
        lambda: first.get("/v0/coverage")["routable"],
        timeout=timeout,
    )
    url = first.status()["gateway"]
    net.wait_until(
        "the gateway on node 0 is ready",
        lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200,
        timeout=timeout,
    )
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
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="paid-per-request", max_retries=0)
    model = client.models.list().data[0].id
    request: CompletionCreateParamsNonStreaming = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    quote = get_quote(gateway, request=request)
    header = trio.run(pay_quote, rpc, consumer, quote)
    began = time.monotonic()
    reply = client.chat.completions.create(**request, extra_headers={PAYMENT_HEADER: header})
    return Answer(
        reply.choices[0].message.content or "",
        int(quote["amount"]),
        header.split(":", 1)[1],
        time.monotonic() - began,
        model,
    )


@dataclass(frozen=True)
class Earned:
    index: int
    """The node."""
    earned: int
    """KVR base units its receipts say it earned (node 0, the gateway: its own share)."""
    operator: int = 0
    """The gateway's operator fee (node 0 only)."""
    insurance: int = 0
    """The gateway's insurance pool (node 0 only)."""


def earnings(net: LocalNet, timeout: float = 30.0) -> list[Earned]:
    """What each node earned from node 0's gateway, once every receipt has arrived."""
    gateway = net.nodes[0]
    ids = {n.peer_id: n for n in net.nodes}

    def owed() -> dict[str, int]:
        return {r["peer_id"]: r["earned"] for r in gateway.get("/v0/wallet")["owed_to_peers"]}

    def delivered() -> bool:
        return all(
            held_from(ids[p], gateway) == amount
            for p, amount in owed().items()
            if p in ids and p != gateway.peer_id
        )

    net.wait_until("every node holds its receipt from the gateway", delivered, timeout)
    due, pools = owed(), gateway.get("/v0/wallet")["pools"]
    return [
        Earned(
            n.index,
            due.get(n.peer_id, 0),
            *((pools["operator"], pools["insurance"]) if n is gateway else (0, 0)),
        )
        for n in net.nodes
    ]


def held_from(node: LocalNode, gateway: LocalNode) -> int:
    """What ``node``'s receipts from ``gateway`` add up to."""
    return sum(
        g["earned"] for g in node.get("/v0/wallet")["gateways"] if g["peer_id"] == gateway.peer_id
    )


@dataclass(frozen=True)
class Paid:
    index: int
    """The node."""
    amount: int
    """KVR base units its claim brought in (checked on chain by the node)."""
    balance: int
    """Its wallet's KVR balance on chain afterwards."""
    signature: str
    """The payout transaction ("" for the gateway, whose share stays in its vault)."""
    note: str = ""
    """Why there is no transaction."""


def claim_all(net: LocalNet) -> list[Paid]:
    """Every node claims from the gateways that owe it; their payouts and balances."""
    if net.chain is None:
        raise LocalNetError("claims are paid on the local chain: start the network with one")
    out = []
    for node in net.nodes:
        answer = node.post("/v0/wallet/claim")
        if "error" in answer:
            raise LocalNetError(f"node{node.index} could not claim: {answer['error']}")
        claims = answer["claims"]
        failed = [c["error"] for c in claims if c["error"]]
        if failed:
            raise LocalNetError(f"node{node.index}'s claim failed: {failed[0]}")
        out.append(
            Paid(
                node.index,
                sum(c["amount"] for c in claims),
                kvr_balance(net, node.wallet()),
                ", ".join(c["signature"] for c in claims),
                "" if claims else "its own share stays in its vault",
            )
        )
    return out


def kvr_balance(net: LocalNet, owner: Pubkey) -> int:
    """KVR base units ``owner`` holds on the network's local chain."""
    if net.chain is None:
        raise LocalNetError("balances are read from the local chain: start the network with one")
    info = net.chain.info

    async def read() -> int:
        async with ChainClient(info["RPC URL"], "confirmed") as chain:
            return await chain.token_balance(owner, Pubkey.from_string(info["KVR mint"]))

    return trio.run(read)
