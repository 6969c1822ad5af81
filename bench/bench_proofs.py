"""What checking a claim costs: one ClaimChecker round (CHALLENGES questions) against a
holder of the bundled model, over the real shard server on in-memory streams.

    .venv/bin/python bench/bench_proofs.py [--rounds 30]

Two verifiers side by side: one that holds the model itself (it asks "prove": a nonce
and random ranges, 32 bytes back) and one that holds none of it (it asks "read": whole
spans, checked against the manifest). Both check a claim of the head and every layer;
the time is the median of --rounds rounds (wall time, this machine), the bytes are what
the holder sent per claim.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import trio
from trio.testing import memory_stream_pair

from kvasird.logs import configure
from kvasird.market.proofs import ClaimChecker
from kvasird.market.records import CoverageRecord, compress
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from kvasird.model.store import ShardStore
from kvasird.model.transfer import serve_shards


class _End:
    """One end of an in-memory stream with a libp2p stream's read/write/close."""

    def __init__(self, stream: trio.abc.Stream, sent: list[int] | None = None) -> None:
        self.stream, self.sent = stream, sent

    async def read(self, n: int | None = None) -> bytes:
        try:
            return await self.stream.receive_some(n)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def write(self, data: bytes) -> None:
        if self.sent is not None:
            self.sent[0] += len(data)
        await self.stream.send_all(data)

    async def close(self) -> None:
        await self.stream.aclose()


async def rounds(holder: ShardStore, verifier: ShardStore, manifest: Manifest,
                 n: int) -> tuple[list[float], list[int], str]:
    sent = [0]
    async with trio.open_nursery() as nursery:
        async def open_stream(peer: str) -> _End:
            client, server = memory_stream_pair()
            nursery.start_soon(serve_shards, _End(server, sent), holder)
            return _End(client)

        times, sizes, verdict = [], [], ""
        for i in range(n):
            record = CoverageRecord("holder", i + 1, time.time(), 10.0, "online", 1, "b", (),
                                    manifest.model_id, 2**40,
                                    compress({u: "online" for u in manifest.unit_sizes}),
                                    boot=f"boot{i}")
            checker = ClaimChecker("me", verifier, open_stream, lambda p, r=record: r,
                                   lambda p, why: None, np.random.default_rng(i))
            checker.note(record, manifest)
            before, began = sent[0], time.perf_counter()
            verdict = await checker.check("holder", manifest)
            times.append((time.perf_counter() - began) * 1000)
            sizes.append(sent[0] - before)
        nursery.cancel_scope.cancel()
    return times, sizes, verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    configure("warning", json=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        holder = ShardStore(root / "h" / "shards", root / "h.db")
        manifest = holder.import_gguf(bundled_path())
        bare = ShardStore(root / "b" / "shards", root / "b.db")
        bare.add_manifest(manifest, source="peer")
        spans = [s for p in manifest.all_pieces for s in p.spans(4 << 20)]
        print(f"bundled model: {len(manifest.all_pieces)} pieces, {len(spans)} spans, "
              f"median span {statistics.median(s[1] for s in spans) / 1024:.0f} KiB, "
              f"largest {max(s[1] for s in spans) / 2**20:.1f} MiB")
        print(f"{'verifier':<22} {'verdict':>8} {'ms/claim p50':>13} {'ms max':>8} "
              f"{'KiB sent p50':>13} {'KiB max':>9}")
        for name, verifier in (("holds the model", holder), ("holds nothing", bare)):
            times, sizes, verdict = trio.run(rounds, holder, verifier, manifest, args.rounds)
            print(f"{name:<22} {verdict:>8} {statistics.median(times):>13.2f} "
                  f"{max(times):>8.2f} {statistics.median(sizes) / 1024:>13.1f} "
                  f"{max(sizes) / 1024:>9.1f}")
        holder.close()
        bare.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
