"""What the serving peers' meter costs decode: a metered ring against an unmetered one.

    .venv/bin/python bench/bench_metering.py [--model bundled|dense] [--pairs 6] [--tokens 64]

Two 3-stage rings of the same model on this machine, each node holding a third: ring A on
the local chain with settlement on (the gateway's requests are its operator's own, paid to
the peers, and the two remote stages meter every step before computing it), ring B with
settlement off (no admission, no meter). Greedy generations of --tokens tokens alternate
A, B, A, B; each pair's decode tok/s ratio (A / B, the time from the first token to the
last) is reported with the medians. Then, in process, what one step's admission and meter
cost alone (µs), against a decode step of ring A.

--model dense uses the generated Llama-3.2-1B-widths model (kvasird_dev.benchmodels,
cached in .cache/bench-models; written on first use, a few minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import trio
from solders.keypair import Keypair

from kvasird.localnet import LocalNet
from kvasird.localnet.placement import pinned
from kvasird.model.bundled import bundled_path
from kvasird.settlement.admission import Admission, Rates
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.pricing import GENESIS_PARAMS
from kvasird.settlement.receipts import ReceiptBook
from kvasird.settlement.wallet import sign_link

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvasird_dev (not installed)
from kvasird_dev.benchmodels import bench_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


def ring(root: Path, model: Path, n_layer: int, paid: bool) -> LocalNet:
    net = LocalNet(root, 3, chain=paid)
    a, b = n_layer // 3, 2 * n_layer // 3
    for node, pins in zip(net.nodes, (["head", f"layers:0-{a}"], [f"layers:{a}-{b}"],
                                      [f"layers:{b}-{n_layer}"]), strict=True):
        node.settings = pinned(model, pins, **{"settlement.claim_threshold": 0,
                                              "inference.step_timeout_s": 120.0})
    net.up()
    url = net.nodes[0].status()["gateway"]
    net.wait_until("the gateway is ready",
                   lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 900)
    return net


def decode_rate(url: str, body: dict[str, object]) -> float:
    """Decode tok/s of one streamed generation: from its first token to its last."""
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def paired(model: Path, n_layer: int, pairs: int, tokens: int) -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as tmp, \
            ring(Path(tmp) / "metered", model, n_layer, paid=True) as metered, \
            ring(Path(tmp) / "free", model, n_layer, paid=False) as free:
        urls = [net.nodes[0].status()["gateway"] for net in (metered, free)]
        name = httpx.get(f"{urls[0]}/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        for url in urls:  # warm: graphs built, lanes up
            decode_rate(url, body)
        rates: list[tuple[float, float]] = []
        for i in range(pairs):  # which ring goes first alternates
            first, second = (0, 1) if i % 2 == 0 else (1, 0)
            got = {first: decode_rate(urls[first], body), second: decode_rate(urls[second], body)}
            rates.append((got[0], got[1]))
        metered_units = metered.nodes[1].get("/v0/wallet").get("metered", {})
        assert metered_units, "ring A's remote stage metered nothing: the bench measures no meter"
    a, b = [r[0] for r in rates], [r[1] for r in rates]
    return [("ring A, metered: decode tok/s", f"{statistics.median(a):8.2f}"),
            ("ring B, no meter: decode tok/s", f"{statistics.median(b):8.2f}"),
            ("A / B per pair (median)", f"{statistics.median(x / y for x, y in rates):8.3f} x"),
            ("A / B per pair (min .. max)",
             f"{min(x / y for x, y in rates):.3f}..{max(x / y for x, y in rates):.3f}"),
            ("a decode step of ring A (ms)", f"{1000 / statistics.median(a):8.2f}")]


def per_step() -> list[tuple[str, str]]:
    """A step's admission (a recent pass) and meter, timed alone on a real ledger."""
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(Path(tmp) / "state.db")
        links = {"gw": sign_link(Keypair(), "gw", "bench")}
        params = replace(GENESIS_PARAMS, credit_units=10**15)

        async def balance(_: object) -> int:
            return params.stake_min

        rule = Admission("me", "bench", links.get, ReceiptBook(ledger, "me", "bench"), balance,
                         lambda: params, max_unpaid=10**9,
                         rates=lambda: Rates(31, 2000, params.floor))

        async def admit() -> None:
            await rule.check("gw", 1.0)
            rule.charge("gw", 10)

        async def timed() -> float:
            await admit()
            n, best = 5000, float("inf")
            for _ in range(5):
                began = time.perf_counter()
                for _ in range(n):
                    await admit()
                best = min(best, (time.perf_counter() - began) / n)
            return best * 1e6

        us = trio.run(timed)
        ledger.close()
    return [("admission + meter of one step (us)", f"{us:8.2f}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bundled", "dense"), default="bundled")
    parser.add_argument("--pairs", type=int, default=6, help="A/B pairs of generations")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    args = parser.parse_args()
    if args.model == "dense":
        model, n_layer = bench_model(ROOT / ".cache" / "bench-models", "dense"), 16
    else:
        model, n_layer = bundled_path(), 30
    rows = paired(model, n_layer, args.pairs, args.tokens) + per_step()
    print(f"metering, {args.model} model, 3-stage ring, {args.tokens} tokens, "
          f"{args.pairs} pairs")
    print(f"{'measurement':40} {'value':>14}")
    for name, value in rows:
        print(f"{name:40} {value:>14}")


if __name__ == "__main__":
    main()
