"""What the stages' spot checks cost: generations at spot_check_stages 0, 0.1 (default), 1.

    .venv/bin/python bench/bench_spotcheck.py [--rounds 3] [--generations 8] [--prompt 64]
                                              [--tokens 32]

Five stage servers in one process, joined by the in-process transport of the gateway's
tests (tests/inference/fakenet.py), on the bundled model: the gateway holds the head and
layers 0-9, two replicas hold layers 10-19 and two layers 20-29, so every hop but the
gateway's own has a checker. Everything computes in this one process, one thing at a
time, so a generation's time is its compute: the ratio of the time at a rate to the time
at 0 is the extra compute the checks cost (a checked session also waits for its checks
before its first token: the time to first token shows it), the checks of the drawn hops'
later steps after each generation (commit and reveal) included. Within a round the rates
alternate, generation by generation; the table gives the median over rounds. Rate 0 still
relays every route's first prompt chunk through the gateway (every rate does, so that a
hop cannot tell a checked session): its cost is in the baseline.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "inference"))

from fakenet import FakeNet, no_experts  # noqa: E402

from kvasird.compute.sampling import SamplingParams  # noqa: E402
from kvasird.config import InferenceConfig  # noqa: E402
from kvasird.inference.api import (  # noqa: E402
    GenerationRequest,
    ModelInfo,
    Sampling,
    TokenEvent,
)
from kvasird.inference.client.routing import Fitness, Latency  # noqa: E402
from kvasird.inference.client.spotcheck import SpotChecks  # noqa: E402
from kvasird.inference.client.swarm import SwarmGenerator  # noqa: E402
from kvasird.inference.server.engine import Holdings, Served  # noqa: E402
from kvasird.logs import configure  # noqa: E402
from kvasird.model.bundled import bundled_path  # noqa: E402

RATES = (0.0, InferenceConfig().spot_check_stages, 1.0)
PARTS = {"gw": Holdings(head=True, windows=((0, 10),)), "b": Holdings(windows=((10, 20),)),
         "b2": Holdings(windows=((10, 20),)), "c": Holdings(windows=((20, 30),)),
         "c2": Holdings(windows=((20, 30),))}


async def one(net: FakeNet, gen: SwarmGenerator, prompt: list[int], tokens: int
              ) -> tuple[float, float]:
    """(seconds, seconds to the first token) of one greedy generation."""
    req = GenerationRequest("m", tuple(prompt), Sampling(SamplingParams(temperature=0), tokens))
    began, first = time.perf_counter(), 0.0
    async with net.running() as nursery:
        gen.nursery = nursery
        async for event in gen.generate(req):
            if isinstance(event, TokenEvent) and not first:
                first = time.perf_counter() - began
    return time.perf_counter() - began, first


async def measure(args: argparse.Namespace) -> None:
    model = bundled_path()
    served = {n: Served.build([model], h, threads=1, kv_slots=1024, remote=no_experts)
              for n, h in PARTS.items()}
    net = FakeNet(served)
    config = {r: InferenceConfig(spot_check_stages=r, prefix_cache=False) for r in RATES}
    spot = {r: SpotChecks(r, 0.0, config[r].spot_tolerance) for r in RATES}
    gens = {r: SwarmGenerator("gw", lambda: ModelInfo("m", "bundled", 2048), lambda: 30,
                              net.holders, net, net.servers["gw"].handle,  # type: ignore[arg-type]
                              Latency("gw", lambda p: 1.0), Fitness(300), config[r], net.inbox,
                              spot=spot[r])
            for r in RATES}
    rng = random.Random(0)
    took: dict[float, list[float]] = {r: [] for r in RATES}
    ttft: dict[float, list[float]] = {r: [] for r in RATES}
    try:
        await one(net, gens[0.0], [1] * args.prompt, 2)  # warm up the graphs
        for _ in range(args.rounds):
            sums = {r: [0.0, 0.0] for r in RATES}
            for _ in range(args.generations):
                prompt = [rng.randrange(1, 49000) for _ in range(args.prompt)]
                for r in RATES:
                    s, first = await one(net, gens[r], prompt, args.tokens)
                    sums[r][0] += s
                    sums[r][1] += first
            for r in RATES:
                took[r].append(sums[r][0] / args.generations)
                ttft[r].append(sums[r][1] / args.generations)
    finally:
        for s in served.values():
            s.close()
    base = statistics.median(took[0.0])
    print(f"prompt {args.prompt} tokens, {args.tokens} generated, {args.generations} "
          f"generations x {args.rounds} rounds, in process (one core's compute)")
    print(f"{'rate':>6} {'s/generation':>13} {'extra':>7} {'TTFT ms':>8} {'hops checked':>13} "
          f"{'later steps checked':>20}")
    for r in RATES:
        t = statistics.median(took[r])
        checked = spot[r].stages.checked / max(spot[r].stages.seen, 1)
        print(f"{r:>6.2f} {t:>13.3f} {t / base - 1:>+7.1%} "
              f"{statistics.median(ttft[r]) * 1000:>8.1f} {checked:>13.1%} "
              f"{spot[r].decode.checked:>20}")
        assert spot[r].stages.caught == 0 and spot[r].stages.unresolved == 0
        assert spot[r].decode.caught == 0 and spot[r].decode.unresolved == 0
        assert spot[r].decode.unshown == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    configure("warning", json=False)  # the table goes to stdout
    trio.run(measure, parser.parse_args())


if __name__ == "__main__":
    main()
