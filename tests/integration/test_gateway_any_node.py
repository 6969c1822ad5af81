"""Any node is a gateway of the model its network serves (#37, finding 1).

A network built by hand, as the README builds one: three homes made with `kvasird init`,
each daemon a real process on 127.0.0.1, settlement on a local chain. A adds the bundled
model; B joins by the model's id and holds its head; C joins by the id and holds nothing.
The gateways of B and C read the tokenizer and chat template from the model's manifest,
fetched from the peers, and answer a chat with A's greedy text."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from solders.keypair import Keypair

from kvasird.config import render
from kvasird.home import Home
from kvasird.localnet.demo import SYSTEM
from kvasird.localnet.launcher import (
    LOCAL_P2P,
    OWN_USE,
    LocalChainProcess,
    LocalNode,
    free_port,
)
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.pricing import GENESIS_STAKE_MIN
from kvasird.settlement.wallet import write_keypair
from tests.support import eventually

pytestmark = pytest.mark.slow

NETWORK = "any-node"
SERVING_S = 90.0
"""How long a gateway may take to serve: the model imported, fetched, enrolled and routed on
a busy 2-core machine."""
NODE = {**LOCAL_P2P, "admin.listen": "127.0.0.1:0", "gateway.listen": "127.0.0.1:0",
        "compute.threads": 1, "market.heartbeat_s": 1.0, "market.enroll_delay_s": 0.0,
        "market.rebalance_s": 2.0, "market.target_replicas": 1,
        "settlement.wallet": "wallet.json", "settlement.commitment": "confirmed"}
"""What each operator edits in the kvasird.toml `init` wrote (fast heartbeats on loopback)."""
QUESTION: dict[str, Any] = {
    "max_tokens": 8, "temperature": 0,
    "messages": [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "What is the capital of France?"}]}


def init(root: Path, name: str, bootstrap: str = "") -> tuple[LocalNode, str]:
    """`kvasird init` a home; return its node and its join address (port chosen here)."""
    home = Home(root / name)
    args = ["--bootstrap", bootstrap] if bootstrap else []
    out = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(home.root), "init",
                          "--network", NETWORK, *args],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    peer_id = next(line.split()[-1] for line in out.splitlines() if line.startswith("peer id"))
    port = free_port()
    configure(home, {"p2p.listen": [f"/ip4/127.0.0.1/tcp/{port}"]})
    write_keypair(home.root / "wallet.json", Keypair())
    return LocalNode(0, home, log=root / f"{name}.log"), f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"


def configure(home: Home, values: dict[str, Any]) -> None:
    home.config.write_text(render(home.config.read_text(), values))


async def fund(rpc: str, nodes: list[LocalNode]) -> None:
    """Each wallet gets the network's stake (it runs a gateway) and KVR for its own use."""
    async with ChainClient(rpc, "confirmed") as chain:
        for node in nodes:
            await chain.faucet(node.wallet(), kvr=GENESIS_STAKE_MIN + OWN_USE, lamports=10**9)


def health(node: LocalNode) -> tuple[int, dict[str, str]]:
    r = httpx.get(node.status()["gateway"] + "/health", timeout=10)
    return r.status_code, r.json()


def wait_until(node: LocalNode, what: str, done: Callable[[], bool]) -> None:
    """Poll ``done`` while the node lives; the failure carries its log."""
    eventually(what, done, timeout=SERVING_S, every=0.3, alive=node.alive,
               context=lambda: f"its log:\n{node.tail()}")


def held(node: LocalNode) -> list[str]:
    return list(node.get("/v0/coverage")["held"])


def listing(node: LocalNode) -> list[tuple[str, int]]:
    """The models the node's gateway lists: (id, context length)."""
    r = httpx.get(node.status()["gateway"] + "/v1/models", timeout=10)
    return [(m["id"], m["context_length"]) for m in r.json()["data"]]


def chat(node: LocalNode, model_id: str) -> str:
    """The answer of the node's OpenAI API."""
    r = httpx.post(node.status()["gateway"] + "/v1/chat/completions",
                   json={"model": model_id, **QUESTION}, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def message(node: LocalNode, model_id: str) -> str:
    """The answer of the node's Anthropic API."""
    system, *messages = QUESTION["messages"]
    r = httpx.post(node.status()["gateway"] + "/v1/messages", timeout=120, json={
        "model": model_id, "max_tokens": QUESTION["max_tokens"], "temperature": 0,
        "system": system["content"], "messages": messages})
    assert r.status_code == 200, r.text
    return "".join(block["text"] for block in r.json()["content"] if block["type"] == "text")


def test_a_node_holding_nothing_and_a_head_holder_answer_chat_like_the_model_adder(
        tmp_path: Path) -> None:
    model_id = Manifest.from_gguf(bundled_path()).model_id
    chain = LocalChainProcess(tmp_path / "chain", tmp_path / "chain.log")
    running: list[LocalNode] = []
    chain.start()
    try:
        a, join = init(tmp_path, "a")
        b, _ = init(tmp_path, "b", join)
        c, _ = init(tmp_path, "c", join)
        settlement = chain.settings()
        configure(a.home, {**NODE, **settlement, "market.model": "bundled:smollm2",
                           "market.memory_budget_mb": 200})
        configure(b.home, {**NODE, **settlement, "market.model": model_id,
                           "market.memory_budget_mb": 40, "market.hold": ["head"]})
        # C's KV slots exceed what the model was trained on: its context is the model's.
        configure(c.home, {**NODE, **settlement, "market.model": model_id,
                           "market.memory_budget_mb": 0, "inference.kv_slots": 16384})
        trio.run(fund, chain.info["RPC URL"], [a, b, c])

        running.append(c)  # first: no peer yet, so no route
        c.start()
        code, body = health(c)
        assert (code, body["status"]) == (503, "starting"), body
        assert "bootstrap" in body["reason"] and model_id[:16] in body["reason"], body

        running.extend([a, b])
        a.spawn()
        b.spawn()
        a.wait_ready()
        b.wait_ready()
        wait_until(b, "B holds the head", lambda: "head" in held(b))
        for node, name in ((a, "A"), (b, "B"), (c, "C")):
            wait_until(node, f"{name}'s gateway serves", lambda n=node: health(n)[0] == 200)
        assert held(c) == []

        listed = [listing(node) for node in (a, b, c)]
        assert len(listed[0]) == 1 and listed[1] == listed[0] and listed[2] == listed[0]
        assert listed[2][0][1] == 8192
        said = chat(a, model_id)
        assert "Paris" in said
        assert chat(b, model_id) == said
        assert chat(c, model_id) == said
        assert message(c, model_id) == said
    finally:
        for node in running:
            node.stop()
        chain.stop()
