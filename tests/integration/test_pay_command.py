"""Paying from the command line, keeping the money of a request that did no work, and
earnings on a network built by hand (no launcher: `kvasird localchain`, homes made with
`kvasird init`, the chain's RPC URL, mint and genesis wallet written into kvasird.toml).

A holds the head and layers 0-28 of the bundled model, B layer 28, C layer 29 (each set in
its own kvasird.toml as `[market] hold`): every request runs A → B → C, and B's and C's
part of it is one layer in thirty, worth less than a base unit of a request's few dozen.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trio
from handbuilt import HandBuilt, hand_built, kvasird

from kvasird.localnet.demo import SYSTEM
from kvasird.localnet.placement import pinned
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from kvasird.settlement.consumer import PAYMENT_HEADER, get_quote, pay_quote
from kvasird.settlement.token import format_kvr
from kvasird.settlement.wallet import read_keypair

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
READY_S = 240.0


def holding(pins: list[str], model: str) -> dict[str, object]:
    """The [market] settings of a node holding ``pins`` of the bundled model, named
    ``model`` (a path on A, the model id on the others)."""
    values = pinned(bundled_path(), pins)
    return {"market.model": model, "market.hold": pins, "market.enroll_delay_s": 0.0,
            "market.target_replicas": 1, "market.memory_budget_mb":
                values["market.memory_budget_mb"]}


@pytest.fixture(scope="module")
def net(module_tmp: Callable[[str], Path]) -> Iterator[HandBuilt]:
    built = hand_built(module_tmp("handbuilt"))
    try:
        model_id = Manifest.from_gguf(bundled_path()).model_id
        a = built.add_node(stake_kvr=101_000, **{**holding(["head", "layers:0-28"],
                                                            "bundled:smollm2"),
                                                 "settlement.free_local": False})
        for pins in (["layers:28-29"], ["layers:29-30"]):
            built.add_node(bootstrap=a.join_addr, **holding(pins, model_id))
        url = gateway(built)
        built.wait_until("A's gateway serves", lambda: httpx.get(
            url + "/health", timeout=5).status_code == 200, READY_S)
        yield built
    finally:
        built.down()


def gateway(built: HandBuilt) -> str:
    return str(built.nodes[0].status()["gateway"])


def consumer(built: HandBuilt, root: Path, kvr: int = 10) -> Path:
    """A consumer's wallet, made and funded with the CLI."""
    path = root / "consumer.json"
    kvasird("wallet", "--keypair", str(path), "new")
    kvasird("wallet", "--keypair", str(path), "--rpc", built.rpc, "faucet", "--kvr", str(kvr))
    return path


def kvr(built: HandBuilt, *wallet: str) -> str:
    """The KVR line of `kvasird wallet`, as printed."""
    out = kvasird("wallet", *wallet, "--rpc", built.rpc).stdout
    return re.search(r"^KVR\s+(\S+)", out, re.M).group(1)  # type: ignore[union-attr]


def test_kvasird_pay_answers_and_the_payer_pays_what_it_prints(net: HandBuilt,
                                                               tmp_path: Path) -> None:
    wallet = consumer(net, tmp_path)
    before = kvr(net, "--keypair", str(wallet))
    done = kvasird("pay", QUESTION, "--gateway", gateway(net), "--wallet", str(wallet),
                   "--rpc", net.rpc, "--system", SYSTEM, "--max-tokens", "8",
                   "--temperature", "0", timeout=300)
    assert "Paris" in done.stdout, done
    paid = re.search(r"^paid\s+(\S+) KVR \(transaction \w+\)", done.stderr, re.M)
    used = re.search(r"^used\s+(\S+) KVR", done.stderr, re.M)
    assert paid and used and "returned" in done.stderr, done.stderr
    after = kvr(net, "--keypair", str(wallet))
    spent = round((float(before) - float(after)) * 10**6)
    assert format_kvr(spent) == paid.group(1)


def test_the_python_example_in_the_docs_pays_and_answers(net: HandBuilt, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    docs = (Path(__file__).parents[2] / "docs" / "market.md").read_text()
    example = docs.split("From Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    wallet = consumer(net, tmp_path)
    exec(example.replace("http://127.0.0.1:8080", gateway(net))  # noqa: S102 - the docs' own
         .replace("http://127.0.0.1:8899", net.rpc).replace("me.json", str(wallet)), {})
    text, costs = capsys.readouterr().out.strip().rsplit("\n", 1)
    paid, used, returned = (int(v) for v in costs.split())
    assert text and paid == used + returned > 0


def test_kvasird_pay_says_how_to_fund_a_wallet_or_make_one(net: HandBuilt,
                                                           tmp_path: Path) -> None:
    url = gateway(net)
    empty = tmp_path / "empty.json"
    kvasird("wallet", "--keypair", str(empty), "new")
    for wallet, says in ((empty, "faucet"), (tmp_path / "none.json", "kvasird wallet new")):
        done = subprocess.run([sys.executable, "-m", "kvasird", "pay", QUESTION, "--gateway",
                               url, "--wallet", str(wallet), "--rpc", net.rpc],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and says in done.stderr, done.stderr


def test_a_paid_request_refused_before_any_work_keeps_its_payment(net: HandBuilt,
                                                                  tmp_path: Path) -> None:
    url = gateway(net)
    payer = read_keypair(consumer(net, tmp_path))
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    good = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 4}
    quote = get_quote(url, request=good)
    header = {PAYMENT_HEADER: trio.run(pay_quote, net.rpc, payer, quote)}
    before = kvr(net, "--address", str(payer.pubkey()))
    for wrong, status in (({"model": "no-such-model"}, 404), ({"temperature": 7}, 400)):
        refused = httpx.post(url + "/v1/chat/completions", json={**good, **wrong},
                             headers=header, timeout=60)
        assert refused.status_code == status, refused.text
        assert "Nothing was charged" in refused.json()["error"]["message"], refused.text
    assert kvr(net, "--address", str(payer.pubkey())) == before
    served = httpx.post(url + "/v1/chat/completions", json=good, headers=header, timeout=300)
    assert served.status_code == 200, served.text


def test_peers_of_a_hand_built_network_see_and_claim_what_the_gateway_owes(
        net: HandBuilt, tmp_path: Path) -> None:
    """Each request pays B and C less than a base unit: they used to earn 0 for it, and
    `kvasird wallet claim` found nothing owed."""
    url = gateway(net)
    wallet = consumer(net, tmp_path)
    for _ in range(5):
        kvasird("pay", QUESTION, "--gateway", url, "--wallet", str(wallet), "--rpc", net.rpc,
                "--max-tokens", "8", "--temperature", "0", timeout=300)
    a, b, c = net.nodes
    owed = {r["peer_id"]: r for r in a.get("/v0/wallet")["owed_to_peers"]}
    assert owed[b.peer_id]["measured_units"] > 0 and owed[c.peer_id]["measured_units"] > 0
    for node in (b, c):
        net.wait_until(f"node {node.index} holds what A owes it", lambda n=node: n.get(
            "/v0/wallet")["pending"] == owed[n.peer_id]["earned"] > 0, 30)
        shown = kvasird("--home", str(node.home.root), "wallet").stdout
        pending = format_kvr(owed[node.peer_id]["earned"])
        assert f"pending earnings  {pending} KVR" in shown, shown
    before = kvr(net, "--home", str(b.home.root))
    claimed = kvasird("--home", str(b.home.root), "wallet", "claim", timeout=180).stdout
    assert f"{format_kvr(owed[b.peer_id]['earned'])} KVR paid" in claimed, claimed
    after = kvr(net, "--home", str(b.home.root))
    assert round((float(after) - float(before)) * 10**6) == owed[b.peer_id]["earned"]


def test_a_paid_request_with_no_route_keeps_its_payment_for_when_there_is_one(
        net: HandBuilt, tmp_path: Path) -> None:
    """Runs last: it stops C, the only holder of layer 29, then starts it again."""
    url = gateway(net)
    wallet = consumer(net, tmp_path)
    c = net.nodes[2]
    c.stop()
    failed = kvasird_fails("pay", QUESTION, "--gateway", url, "--wallet", str(wallet),
                           "--rpc", net.rpc, "--max-tokens", "4")
    assert "(503)" in failed and "Nothing was charged" in failed, failed
    header = re.search(r"X-Kvasir-Payment: (\S+)\)", failed).group(1)  # type: ignore[union-attr]
    before = kvr(net, "--keypair", str(wallet))
    c.start()
    net.wait_until("A routes through C again", lambda: httpx.get(
        url + "/health", timeout=5).status_code == 200, READY_S)
    done = kvasird("pay", QUESTION, "--gateway", url, "--wallet", str(wallet), "--rpc",
                   net.rpc, "--max-tokens", "4", "--payment", header, timeout=300)
    assert done.stdout.strip() and "paid" in done.stderr, done
    assert kvr(net, "--keypair", str(wallet)) == before


def kvasird_fails(*args: str) -> str:
    """The error `kvasird ARGS` exits 1 with."""
    done = subprocess.run([sys.executable, "-m", "kvasird", *args], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done
    return done.stderr
