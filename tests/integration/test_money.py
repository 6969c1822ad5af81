"""The money loop with real daemons and the local chain: paid requests become the serving
peers' on-chain earnings, nobody rides free, and a failed paid request is refunded.

Placement is pinned (``market.hold``, as in test_swarm) so that the test can count each
peer's work itself: a greedy generation of n tokens (end of text ignored) over a prompt of
p tokens runs p + n - 1 positions through every hop; a stage's units are positions x its
layers (the head counting as one); an expert worker's are rows x experts, and every row of
every MoE layer selects exactly ``n_expert_used`` experts.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.system_program import TransferParams, transfer

from kvasird.gateway import dashboard
from kvasird.localnet import LocalNet
from kvasird.localnet.demo import held_from, kvr_balance
from kvasird.localnet.launcher import OWN_USE, LocalNode
from kvasird.localnet.placement import pinned
from kvasird.model.bundled import bundled_path
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.consumer import PAYMENT_HEADER, funded_wallet, get_quote, pay_quote
from kvasird.settlement.pricing import GENESIS_STAKE_MIN
from kvasird.settlement.wallet import read_keypair
from kvasird_dev.testmodels import make_model

pytestmark = pytest.mark.slow

KVR = 10**6
N_TOKENS = 4
PROMPT = "The capital of France is"
READY_S = 120.0


def settings(model: Path, pins: list[str], **extra: Any) -> dict[str, Any]:
    return pinned(model, pins, **{"settlement.free_local": False,
                                  "settlement.claim_threshold": 0, **extra})


def paid_net(localnet: Callable[..., LocalNet], model: Path, placement: list[list[str]],
             node_settings: dict[int, dict[str, Any]] | None = None,
             stakes: dict[int, int] | None = None, **extra: Any) -> LocalNet:
    """A network on the local chain whose node i holds placement[i] (a node with no pins
    has a budget of 0: a pure gateway)."""
    net = localnet(len(placement), chain=True)
    for node, pins in zip(net.nodes, placement, strict=True):
        node.settings = {**settings(model, pins, **extra), **(node_settings or {}).get(
            node.index, {})}
        node.stake = (stakes or {}).get(node.index)
    net.up()
    holders = sum(1 for pins in placement if pins)
    net.wait_until("the gateway sees every holder online and proven",
                   lambda: online_holders(net.nodes[0]) == holders, READY_S)
    return net


def online_holders(node: LocalNode) -> int:
    """Holders online whose claims `node` has proven (it routes to, and dispatches experts
    to, proven holders only: a first request before that is refused "busy")."""
    holders = node.get("/v0/coverage").get("holders") or {}
    return sum(
        1
        for peer, h in holders.items()
        if h["holdings"]
        and all(x[-1] == "online" for x in h["holdings"])
        and (peer == node.peer_id or h["proven_units"])
    )


def gateway_of(net: LocalNet, node: LocalNode) -> tuple[str, openai.OpenAI]:
    url = node.status()["gateway"]
    net.wait_until(f"the gateway of node {node.index} is ready",
                   lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, READY_S)
    return url, openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)


class Consumer:
    """A wallet that pays a gateway per request, as a developer's client would."""

    def __init__(self, net: LocalNet, url: str, client: openai.OpenAI) -> None:
        assert net.chain is not None
        self.rpc, self.url, self.client = net.chain.info["RPC URL"], url, client
        self.wallet = trio.run(funded_wallet, self.rpc, 100 * KVR)
        self.model = client.models.list().data[0].id
        self.paid = 0

    def ask(self, prompt: str = PROMPT, n: int = N_TOKENS) -> Any:
        """A paid completion of n tokens, quoted for its own body: it runs to max_tokens
        (ignore_eos), so it uses all it paid for and nothing is credited back."""
        request = {"model": self.model, "prompt": prompt, "max_tokens": n, "temperature": 0}
        quote = get_quote(self.url, request=request)
        header = trio.run(pay_quote, self.rpc, self.wallet, quote)
        self.paid += int(quote["amount"])
        return self.client.completions.create(**request, extra_body={"ignore_eos": True},
                                              extra_headers={PAYMENT_HEADER: header})


def positions(answer: Any) -> int:
    """Positions every hop computed for a generation that ran to max_tokens."""
    assert answer.choices[0].finish_reason == "length"
    return answer.usage.prompt_tokens + answer.usage.completion_tokens - 1


def owed(gateway: LocalNode) -> dict[str, dict[str, int]]:
    return {r["peer_id"]: r for r in gateway.get("/v0/wallet")["owed_to_peers"]}


def claim_and_check(net: LocalNet, gateway: LocalNode, consumer: Consumer,
                    claims_itself: frozenset[int] = frozenset()) -> None:
    """Every serving peer holds receipts equal to what the gateway owes it, claims them (the
    nodes in ``claims_itself`` without being asked, past their claim_threshold), and its
    on-chain balance rises from its stake by exactly that; the whole revenue is accounted
    for."""
    due = owed(gateway)
    net.wait_until("every peer holds its receipts", lambda: all(
        held_from(n, gateway) == due[n.peer_id]["earned"]
        for n in net.nodes if n is not gateway and n.peer_id in due), 30)
    wallet = gateway.get("/v0/wallet")
    workers = sum(r["earned"] for r in due.values())
    assert workers + wallet["pools"]["operator"] + wallet["pools"]["insurance"] == consumer.paid
    for node in net.nodes:
        if node is gateway or node.peer_id not in due:
            continue
        if node.index in claims_itself:
            net.wait_until(f"node {node.index} claims by itself",
                           lambda n=node: n.get("/v0/wallet")["pending"] == 0, 30)
        else:
            answer = node.post("/v0/wallet/claim")
            assert [c["error"] for c in answer["claims"]] == [""], answer
        assert kvr_balance(net, node.wallet()) - GENESIS_STAKE_MIN - OWN_USE == due[
                node.peer_id]["earned"]
        assert node.get("/v0/wallet")["pending"] == 0
    assert all(r["paid"] == r["earned"] for p, r in owed(gateway).items() if p != gateway.peer_id)


def test_ring_peers_are_paid_on_chain_exactly_their_measured_share(
        localnet: Callable[..., LocalNet]) -> None:
    # speculation off: a rejected guess is a row computed and paid beyond the positions
    net = paid_net(localnet, bundled_path(),
                   [["head", "layers:0-10"], ["layers:10-20"], ["layers:20-30"]],
                   **{"inference.step_timeout_s": 3.0, "inference.speculate": "off"})
    gateway = net.nodes[0]
    url, client = gateway_of(net, gateway)
    with pytest.raises(openai.APIStatusError) as unpaid:
        client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                  max_tokens=N_TOKENS)
    assert unpaid.value.status_code == 402
    consumer = Consumer(net, url, client)
    done = sum(positions(consumer.ask()) for _ in range(10))
    due = owed(gateway)
    layers = {net.nodes[0].peer_id: 11, net.nodes[1].peer_id: 10, net.nodes[2].peer_id: 10}
    assert {p: r["measured_units"] for p, r in due.items()} == {
        p: done * n for p, n in layers.items()}
    assert all(due[n.peer_id]["earned"] > 0 for n in net.nodes)
    claim_and_check(net, gateway, consumer)
    earned = due[net.nodes[1].peer_id]["earned"]
    assert net.nodes[1].status()["earnings"] == {"earned": earned, "received": earned,
                                                 "pending": 0, "gateways": 1}
    page = httpx.get(net.nodes[1].status()["gateway"] + "/", timeout=10).text
    assert f"<th>received on chain</th><td>{dashboard.kvr(earned)}</td>" in page

    # a paid request that fails before its first token charges nothing: its payment stays
    # usable for the request sent again
    net.nodes[2].signal(signal.SIGKILL)  # the only holder of layers 20-30: no route is left
    net.nodes[2].proc.wait(10)  # type: ignore[union-attr]
    with pytest.raises(openai.APIStatusError) as failed:
        consumer.ask()
    assert "Nothing was charged" in str(failed.value), failed.value


def test_moe_ring_pays_the_expert_only_peers_for_their_rows(
        localnet: Callable[..., LocalNet], tmp_path: Path) -> None:
    n_layer, n_used = 4, 2
    moe = make_model(tmp_path / "moe.gguf", n_layer=n_layer, n_expert=8, n_expert_used=n_used,
                     n_embd=128, n_head=8, n_head_kv=4, head_dim=128, n_ff_exp=768,
                     dtype="f32", tied_output=True)

    def experts(lo: int, hi: int) -> list[str]:
        return [f"experts:{layer}:{lo}-{hi}" for layer in range(n_layer)]

    # A busy 2-core machine (the suite runs two multi-daemon tests at once) can hold an
    # expert call past the 5 s default twice in a row, and a worker that failed twice is not
    # asked again: this test is about who is paid, not how fast, so the stages wait longer.
    # Speculation off: its rejected guesses are work paid too (a CI run's node 0 computed
    # 246 units for 80 positions), and this test counts one computed row a position.
    net = paid_net(localnet, moe, [["head", "layers:0-2"], ["layers:2-4"], experts(0, 4),
                                   experts(4, 8)],
                   node_settings={3: {"settlement.claim_threshold": 1}},
                   **{"inference.expert_timeout_s": 30.0, "inference.speculate": "off"})
    gateway = net.nodes[0]
    url, client = gateway_of(net, gateway)
    consumer = Consumer(net, url, client)
    done = sum(positions(consumer.ask()) for _ in range(10))
    due = owed(gateway)
    units = {n.index: due.get(n.peer_id, {}).get("measured_units", 0) for n in net.nodes}
    assert units[0] == done * 3 and units[1] == done * 2
    assert units[2] > 0 and units[3] > 0
    assert units[2] + units[3] == done * n_layer * n_used  # every row's experts, remote
    assert all(due[n.peer_id]["earned"] > 0 for n in net.nodes)
    claim_and_check(net, gateway, consumer, claims_itself=frozenset({3}))


def test_only_staked_paying_gateways_are_served(localnet: Callable[..., LocalNet]) -> None:
    """Node 0 pays (and is served while it pays); node 3 runs with settlement off; node 4
    holds less than the stake minimum; node 5's requests are its operator's own (free_local):
    it pays the peers for them from its wallet, so they serve it however many it makes."""
    free_local = {"settlement.free_local": True}
    net = paid_net(localnet, bundled_path(),
                   [["head", "layers:0-10"], ["layers:10-20"], ["layers:20-30"], [], [], []],
                   node_settings={1: {"settlement.max_unpaid": 0},
                                  2: {"settlement.max_unpaid": 0},
                                  3: {"settlement.enabled": False}, 4: free_local, 5: free_local},
                   stakes={4: GENESIS_STAKE_MIN - 1})
    # node 3 is refused by the peers; node 4's own gateway knows its wallet is short
    for index, code, why in ((3, 503, "announces no payout wallet"),
                             (4, 402, "below the network's stake minimum")):
        _, client = gateway_of(net, net.nodes[index])
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                      max_tokens=N_TOKENS)
        assert refused.value.status_code == code and why in str(refused.value), refused.value
    url3 = net.nodes[3].status()["gateway"]  # its /health says why, until it is served again
    health = httpx.get(f"{url3}/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "not_served", health.text
    assert "announces no payout wallet" in health.json()["reason"]

    _, client = gateway_of(net, net.nodes[5])
    model = client.models.list().data[0].id
    own = net.nodes[5]
    for _ in range(6):  # its own requests, receipted and paid to the peers like anyone's
        assert client.completions.create(model=model, prompt=PROMPT,
                                         max_tokens=N_TOKENS).choices[0].text
        for peer in net.nodes[1:3]:  # they let nothing go unpaid: each claims before the next
            net.wait_until("the peer holds node 5's new receipt", lambda p=peer: any(
                g["pending"] > 0 for g in p.get("/v0/wallet")["gateways"]
                if g["peer_id"] == own.peer_id), 30)
            assert [c["error"] for c in peer.post("/v0/wallet/claim")["claims"]] == [""]
    assert own.get("/v0/wallet")["own_use"]["requests"] == 6

    # node 0 pays; once its vault cannot pay the claims (no SOL for fees), peers that let
    # nothing go unpaid refuse it; paid again, it is served again
    gateway = net.nodes[0]
    url, client = gateway_of(net, gateway)
    consumer = Consumer(net, url, client)
    consumer.ask()
    net.wait_until("node 1 holds its receipt", lambda: net.nodes[1].get("/v0/wallet")["pending"]
                   > 0, 30)
    vault = read_keypair(gateway.home.root / "wallet.json")
    lamports = drain_sol(net, vault)
    assert net.nodes[1].post("/v0/wallet/claim")["claims"][0]["error"]
    with pytest.raises(openai.APIStatusError) as owing:
        consumer.ask()
    assert owing.value.status_code == 503 and "unpaid receipts" in str(owing.value)
    assert "Nothing was charged" in str(owing.value)
    refill_sol(net, vault.pubkey(), lamports)
    for node in net.nodes[1:3]:
        assert [c["error"] for c in node.post("/v0/wallet/claim")["claims"]] == [""]
    assert consumer.ask().choices[0].text


def drain_sol(net: LocalNet, wallet: Keypair) -> int:
    """Move (nearly) all of ``wallet``'s SOL away: it can no longer pay transaction fees."""
    assert net.chain is not None

    async def drain() -> int:
        async with ChainClient(net.chain.info["RPC URL"], "confirmed") as chain:
            have = await chain.lamports(wallet.pubkey())
            sink = Keypair().pubkey()
            await chain.send_and_confirm([wallet], [transfer(TransferParams(
                from_pubkey=wallet.pubkey(), to_pubkey=sink, lamports=have - 5000))])
            return have
    return trio.run(drain)


def refill_sol(net: LocalNet, owner: Pubkey, lamports: int) -> None:
    assert net.chain is not None

    async def refill() -> None:
        async with ChainClient(net.chain.info["RPC URL"], "confirmed") as chain:
            await chain.faucet(owner, lamports=lamports)
    trio.run(refill)
