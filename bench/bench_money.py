"""What settlement costs a paid request through real daemons, side by side with a free one.

    .venv/bin/python bench/bench_money.py [--rounds 10] [--tokens 8]

A 3-stage ring of the bundled model on the local chain (every node with settlement on).
Each round asks node 0's gateway the same greedy completion twice, A then B: once as the
operator's own request (no quote; the gateway pays the peers from its wallet) and once paid
by a consumer (quote, KVR transfer, verification on chain, then the generation, then
receipts to both remote peers). Reported: medians over rounds
of each part, the paid/free ratio of the generation itself per pair (what being paid adds
on the serving path), and a claim round trip (peer -> gateway over libp2p -> payout on
chain -> the peer checks it). Then, in process, what the accounting adds to one decode
step (the per-step counting at the gateway, the session tally at a stage).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import trio

from bench_metering import ring

from kvasird.inference.client.routing import Fitness, Hop, Route
from kvasird.inference.client.swarm import Progress, _Run
from kvasird.inference.protocol.experts import selections
from kvasird.inference.stepcontext import TALLY, Tally
from kvasird.localnet import LocalNet
from kvasird.model.bundled import bundled_path
from kvasird.settlement.consumer import PAYMENT_HEADER, funded_wallet, get_quote, pay_quote

PROMPT = "The capital of France is"


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def paid_ring(root: Path) -> LocalNet:
    return ring(root, bundled_path(), 30, paid=True)


def receipts_of(net: LocalNet) -> dict[str, int]:
    gateway = net.nodes[0]
    return {n.peer_id: sum(g["earned"] for g in n.get("/v0/wallet")["gateways"]
                           if g["peer_id"] == gateway.peer_id) for n in net.nodes[1:]}


def run_daemons(rounds: int, tokens: int) -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as tmp, paid_ring(Path(tmp) / "ln") as net:
        assert net.chain is not None
        rpc, url = net.chain.info["RPC URL"], net.nodes[0].status()["gateway"]
        consumer = trio.run(funded_wallet, rpc, 1000 * 10**6)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        parts: dict[str, list[float]] = {k: [] for k in (
            "free", "quote", "pay", "paid", "receipts", "ratio")}
        with httpx.Client(timeout=120) as http:
            net.wait_until("the ring serves", lambda: http.post(
                f"{url}/v1/completions", json=body).status_code == 200, 180)
            for _ in range(rounds):
                t = time.perf_counter()
                http.post(f"{url}/v1/completions", json=body).raise_for_status()
                free = time.perf_counter() - t
                before = receipts_of(net)
                t0 = time.perf_counter()
                quote = get_quote(url, request=body)
                t1 = time.perf_counter()
                header = trio.run(pay_quote, rpc, consumer, quote)
                t2 = time.perf_counter()
                http.post(f"{url}/v1/completions", json=body,
                          headers={PAYMENT_HEADER: header}).raise_for_status()
                t3 = time.perf_counter()
                while receipts_of(net) == before:
                    time.sleep(0.002)
                t4 = time.perf_counter()
                for key, value in (("free", free), ("quote", t1 - t0), ("pay", t2 - t1),
                                   ("paid", t3 - t2), ("receipts", t4 - t3)):
                    parts[key].append(value)
                parts["ratio"].append((t3 - t2) / free)
            claims = []
            for node in net.nodes[1:]:
                t = time.perf_counter()
                answer = node.post("/v0/wallet/claim")
                claims.append(time.perf_counter() - t)
                assert all(not c["error"] for c in answer["claims"]), answer
    return [
        ("operator's own request (no quote)", f"{med(parts['free']):8.1f} ms"),
        ("paid: quote", f"{med(parts['quote']):8.1f} ms"),
        ("paid: transfer on chain (consumer side)", f"{med(parts['pay']):8.1f} ms"),
        ("paid: request incl. verification on chain", f"{med(parts['paid']):8.1f} ms"),
        ("paid: then until both peers hold receipts", f"{med(parts['receipts']):8.1f} ms"),
        ("paid request / own request (per pair)",
         f"{statistics.median(parts['ratio']):8.2f} x"),
        ("claim: peer -> gateway -> payout -> checked", f"{med(claims):8.1f} ms"),
        ("claims per second, one peer at a time", f"{1 / statistics.median(claims):8.1f} /s"),
    ]


def accounting_per_step() -> list[tuple[str, str]]:
    """The bookkeeping a decode step now does, timed alone (µs)."""
    hops = (Hop("a", 0, 10, True, False), Hop("b", 10, 20, False, False),
            Hop("c", 20, 30, False, True))
    run: Any = _Run.__new__(_Run)
    run.route, run.units, run.positions, run.progress = Route(hops, 1.0), Counter(), Counter(), \
        Progress()
    run.gen = SimpleNamespace(fitness=Fitness(300))  # the one thing _count asks of the generator
    tally, one_row = Tally("gw"), np.array([[3, 5]])

    def stage_call() -> None:
        token = TALLY.set(tally)
        tally.experts["w"] += selections(one_row)
        TALLY.reset(token)

    n = 20000
    step = min(timeit.repeat(lambda: run._count(1), number=n, repeat=5)) / n * 1e6
    expert = min(timeit.repeat(stage_call, number=n, repeat=5)) / n * 1e6
    return [("gateway: count a step on a 3-hop route", f"{step:8.2f} us"),
            ("stage: tally one remote expert call", f"{expert:8.2f} us")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="paired free/paid requests")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per request")
    args = parser.parse_args()
    rows = run_daemons(args.rounds, args.tokens) + accounting_per_step()
    print(f"{'measurement (medians)':46} {'value':>11}")
    for name, value in rows:
        print(f"{name:46} {value:>11}")


if __name__ == "__main__":
    main()
