"""What an exact failover replay costs: generated tokens replayed one position at a time
(as the decode steps they were, Step.singly) against one batch (which rounds differently).

    .venv/bin/python bench/bench_replay.py [--threads 2] [--rounds 5]

On the bundled model, whole (one stage: the compute a ring's hops share), after a
64-token prompt: the time to rebuild the KV of k generated tokens both ways, medians of
--rounds, and whether each way's next logits equal the undisturbed run's bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvasird.compute.stage import Stage
from kvasird.model.bundled import bundled_path

PROMPT = [1, *range(500, 563)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    stage = Stage.load(bundled_path(), threads=args.threads)
    with stage.open_session() as s:
        logits = [stage.forward(s, np.array(PROMPT))[-1]]
        tokens: list[int] = []
        for _ in range(64):
            tokens.append(int(np.argmax(logits[-1])))
            logits.append(stage.forward(s, np.array(tokens[-1:]))[-1])
    print(f"{'k':>4} {'batch ms':>10} {'singly ms':>10} {'ms/token':>9} "
          f"{'batch exact':>12} {'singly exact':>13}")
    for k in (4, 16, 64):
        times: dict[str, list[float]] = {"batch": [], "singly": []}
        exact: dict[str, bool] = {}
        for _ in range(args.rounds):
            for way in ("batch", "singly"):
                with stage.open_session() as s:
                    stage.forward(s, np.array(PROMPT))
                    began = time.perf_counter()
                    if way == "batch":
                        out = stage.forward(s, np.array(tokens[:k]))[-1]
                    else:
                        for t in tokens[:k]:
                            out = stage.forward(s, np.array([t]))[-1]
                    times[way].append(time.perf_counter() - began)
                    exact[way] = bool(np.array_equal(out, logits[k]))
        b, o = (statistics.median(times[w]) * 1000 for w in ("batch", "singly"))
        print(f"{k:>4} {b:>10.1f} {o:>10.1f} {o / k:>9.1f} {exact['batch']!s:>12} "
              f"{exact['singly']!s:>13}")
    stage.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
