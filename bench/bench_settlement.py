"""Settlement on the local chain: quote→pay→verify latency, claims per second, RPC round trip.

    .venv/bin/python bench/bench_settlement.py [--n 100] [--price-simulation price.png]

Everything runs in one process, as in a daemon with the embedded local chain: the
LiteSVM facade (trio + h11 on 127.0.0.1), solana-py's AsyncClient, SQLite (WAL) ledger.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import tempfile
import time
import zlib
from pathlib import Path

import trio
from solders.keypair import Keypair

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.claims import Payouts
from kvasird.settlement.config import RevenueSplit, TierThresholds
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo, serve_local_chain
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.payments import Payments
from kvasird.settlement.pricing import NetworkParams, PriceController
from kvasird.settlement.rewards import MeasuredWork, Rewards
from kvasird.settlement.token import transfer_instructions

KVR = 10**6


def ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{statistics.median(ordered) * 1e3:8.2f} {p99 * 1e3:8.2f}"


async def bench(n: int, data: Path) -> list[tuple[str, str, str]]:
    rows = []
    async with trio.open_nursery() as nursery:
        info: LocalChainInfo = await nursery.start(serve_local_chain, data / "chain")
        async with ChainClient(info.url, poll_interval_s=0.002) as chain:
            rtt = []
            for _ in range(n):
                t = time.perf_counter()
                await chain.latest_blockhash()
                rtt.append(time.perf_counter() - t)
            rows.append(("RPC round trip (getLatestBlockhash)", ms(rtt), f"{n} calls"))

            ledger = Ledger(data / "state.db")
            vault, consumer = Keypair(), Keypair()
            await chain.faucet(vault.pubkey(), lamports=10**10)
            await chain.faucet(consumer.pubkey(), kvr=10**6 * KVR, lamports=10**10)
            locks = KeyedLocks()
            params = NetworkParams(0, KVR, KVR, 0.5, 0.5, 0.5)
            payments = Payments(
                ledger,
                chain,
                vault=vault.pubkey(),
                mint=info.mint,
                prices=PriceController(params),
                locks=locks,
            )
            rewards = Rewards(ledger, vault, "bench", RevenueSplit(), TierThresholds())
            total, pay_part, verify_part = [], [], []
            for i in range(n):
                t0 = time.perf_counter()
                quote = payments.quote(1000)
                sig = await chain.send_and_confirm(
                    [consumer],
                    transfer_instructions(
                        consumer.pubkey(),
                        vault.pubkey(),
                        info.mint,
                        quote.amount,
                        quote.reference.encode(),
                    ),
                )
                t1 = time.perf_counter()
                await payments.settle_quote(quote.request_id, sig)
                t2 = time.perf_counter()
                total.append(t2 - t0)
                pay_part.append(t1 - t0)
                verify_part.append(t2 - t1)
                rewards.settle(quote.request_id, [MeasuredWork(f"peer{i}", 100, 20.0)], epoch=1)
            rows.append(("quote→pay→verified (total)", ms(total), f"{n} payments"))
            rows.append(("  of which pay + finalize", ms(pay_part), ""))
            rows.append(("  of which verify + credit", ms(verify_part), ""))

            payouts = Payouts(ledger, chain, vault, info.mint, locks, confirm_timeout_s=10)
            half = n // 2
            t = time.perf_counter()
            for i in range(half):
                await payouts.claim(f"peer{i}", Keypair().pubkey())
            sequential = half / (time.perf_counter() - t)
            t = time.perf_counter()
            async with trio.open_nursery() as claims:
                for i in range(half, n):
                    claims.start_soon(payouts.claim, f"peer{i}", Keypair().pubkey())
            concurrent = (n - half) / (time.perf_counter() - t)
            rows.append(
                ("claims/s, one after another", f"{sequential:8.1f} {'':8}", f"{half} claims")
            )
            rows.append(
                (
                    "claims/s, distinct peers at once",
                    f"{concurrent:8.1f} {'':8}",
                    f"{n - half} claims",
                )
            )
            ledger.close()
        nursery.cancel_scope.cancel()
    return rows


def simulate_prices(steps: int = 400) -> list[tuple[float, float, float, float]]:
    """Supply and demand both grow; returns (nodes, utilization, price, revenue/node) per step.

    Each node offers 1000 tokens per step; demand grows faster than supply at first
    (congestion), then supply overtakes it (idle capacity). Demand is mildly price-elastic.
    """
    prices = PriceController()
    reference = prices.price
    rows = []
    for step in range(steps):
        x = step / steps
        nodes = 10 + 190 * x
        wanted = 4_000 + 220_000 * x**0.6 * (1 - 0.35 * x)
        demand = wanted * (reference / prices.price) ** 0.5
        served = min(demand, nodes * 1000)
        price = prices.observe(served / (nodes * 1000))
        revenue = price * served / 1000 * RevenueSplit().workers_bps / 10_000 / nodes
        rows.append((nodes, served / (nodes * 1000), price, revenue))
    return rows


def write_plot(path: Path, series: list[tuple[str, list[float], tuple[int, int, int]]]) -> None:
    """Stacked line panels (one per series, each scaled to its own range) as an RGB PNG."""
    width, panel = 800, 180
    height = panel * len(series)
    pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            pixels[(y * width + x) * 3 : (y * width + x) * 3 + 3] = bytes(color)

    for index, (_, values, color) in enumerate(series):
        top, lo, hi = index * panel, min(values), max(values) or 1.0
        for x in range(width):
            dot(x, top + panel - 1, (160, 160, 160))
        points = [
            (
                int(i * (width - 1) / (len(values) - 1)),
                top + 10 + int((panel - 20) * (1 - (v - lo) / ((hi - lo) or 1.0))),
            )
            for i, v in enumerate(values)
        ]
        for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
            for t in range(max(abs(x1 - x0), abs(y1 - y0), 1) + 1):
                f = t / max(abs(x1 - x0), abs(y1 - y0), 1)
                for dy in (0, 1):
                    dot(round(x0 + (x1 - x0) * f), round(y0 + (y1 - y0) * f) + dy, color)
    raw = b"".join(
        b"\0" + bytes(pixels[r * width * 3 : (r + 1) * width * 3]) for r in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def price_simulation(path: Path) -> None:
    rows = simulate_prices()
    write_plot(
        path,
        [
            ("nodes", [r[0] for r in rows], (90, 90, 90)),
            ("utilization", [r[1] for r in rows], (200, 120, 0)),
            ("price", [float(r[2]) for r in rows], (0, 90, 200)),
            ("revenue per node", [r[3] for r in rows], (0, 150, 60)),
        ],
    )
    print(f"{'step':>5} {'nodes':>6} {'util':>6} {'price/1k tok':>12} {'revenue/node':>13}")
    for step in range(0, len(rows), len(rows) // 8):
        nodes, util, price, revenue = rows[step]
        print(f"{step:5d} {nodes:6.0f} {util:6.2f} {price:12.0f} {revenue:13.0f}")
    print(f"panels (top to bottom): nodes, utilization, price, revenue per node -> {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="samples per measurement")
    parser.add_argument(
        "--price-simulation",
        type=Path,
        default=None,
        metavar="PNG",
        help="instead: simulate price and node revenue as the network grows",
    )
    args = parser.parse_args()
    if args.price_simulation:
        price_simulation(args.price_simulation)
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = trio.run(bench, args.n, Path(tmp))
    print(f"{'measurement':38} {'median':>8} {'p99':>8}  (ms, or per second)")
    for name, value, note in rows:
        print(f"{name:38} {value}  {note}")


if __name__ == "__main__":
    main()
