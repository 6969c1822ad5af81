"""A kvasird with one fault, for tests that need a misbehaving peer: a LocalNode whose
``command`` is ``command(FAULT)`` runs ``python faulty_daemon.py FAULT --home HOME run``.

The fault goes in front of one of the daemon's servers, in this process only, through
the seam that server's constructor offers; then the normal ``kvasird`` main runs:

    slow=BYTES_PER_S  shard serving throttled (a holder to kill mid-transfer)
    flip              shard pieces served with their first byte flipped (a lying holder)
    lying-experts     expert outputs off by a little (a worker spot checks must catch)
    lying-stage       a stage's hidden rows off by a little (a stage spot checks must catch)
    lying-decode      a stage honest on relayed steps that computes the decode steps forwarded
                      to it on garbage (one only the rows it must show catch)
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvasird.cli import main
from kvasird.daemon import node
from kvasird.inference import service
from kvasird.inference.protocol import tensors
from kvasird.inference.server.experts import ExpertServer
from kvasird.inference.server.stage import StageServer
from kvasird.model.distribution import ShardService
from kvasird.model.store import ShardStore
from kvasird.model.transfer import ShardSource
from kvasird.p2p import P2PNode


def command(fault: str) -> list[str]:
    """A LocalNode's ``command`` for a daemon with ``fault``."""
    return [sys.executable, str(Path(__file__).resolve()), fault]


class SlowStore:
    """Serves what the store holds at ``rate`` bytes/s (read in the server's worker thread)."""

    def __init__(self, store: ShardStore, rate: float) -> None:
        self.store, self.rate = store, rate

    def manifest_bytes(self, model_id: str) -> bytes | None:
        return self.store.manifest_bytes(model_id)

    def read_range(self, model_id: str, tensor: str, expert: int, offset: int,
                   length: int) -> bytes | None:
        time.sleep(length / self.rate)
        return self.store.read_range(model_id, tensor, expert, offset, length)


class FlippingStore(SlowStore):
    """Serves every piece with its first byte flipped: it fails the learner's hash check."""

    def __init__(self, store: ShardStore) -> None:
        super().__init__(store, float("inf"))

    def read_range(self, model_id: str, tensor: str, expert: int, offset: int,
                   length: int) -> bytes | None:
        data = self.store.read_range(model_id, tensor, expert, offset, length)
        return None if data is None else bytes([data[0] ^ 0xFF]) + data[1:]


class LyingExperts(ExpertServer):
    """Answers expert requests with outputs scaled and shifted off the true ones."""

    async def answer(self, caller: str, request: Any) -> dict[str, Any]:
        reply = await super().answer(caller, request)
        out = tensors.decode(reply["out"], "out", ("f32", "f16"), (None, None, None))
        return {**reply, "out": tensors.encode(out * 1.5 + 0.01, self.wire_dtype)}


class LyingStage(StageServer):
    """Answers steps with its hidden rows scaled and shifted off the true ones, relayed or
    forwarded alike (the head's tokens it leaves alone)."""

    async def _step(self, s: Any, m: Any, *rest: Any) -> Any:
        out = await super()._step(s, m, *rest)
        return out * 1.5 + 0.01 if isinstance(out, np.ndarray) else out


class LyingDecode(StageServer):
    """Computes every relayed step (a route's first prompt chunk, a check's recomputation)
    honestly, and each decode step forwarded to it on garbage in place of the rows it was
    sent: it reads the code, and lies only where the gateway does not see its rows (its
    ledger holds what it really received and sent: a commitment that contradicts its
    neighbours' would cost it its pay at once)."""

    async def _step(self, s: Any, m: Any, *rest: Any) -> Any:
        if m.forward is not None and m.dt != "i32" and len(m.x) == 1:
            # the row's own values shuffled: garbage of the right magnitude (noise scaled
            # to the largest value can overflow the next hop's f16 rows, which would blame it)
            m = dataclasses.replace(m, x=np.random.default_rng().permutation(m.x, axis=1))
        return await super()._step(s, m, *rest)


def _serving(wrap: Callable[[ShardStore], ShardSource]) -> Callable[..., ShardService]:
    def shards(p2p: P2PNode, store: ShardStore) -> ShardService:
        return ShardService(p2p, store, source=wrap(store))
    return shards


def install(fault: str) -> None:
    """Put ``fault`` where the daemon about to run in this process builds that server."""
    name, _, arg = fault.partition("=")
    shards: dict[str, Callable[[ShardStore], ShardSource]] = {
        "slow": lambda store: SlowStore(store, float(arg)), "flip": FlippingStore}
    if name in shards:
        node.ShardService = _serving(shards[name])  # type: ignore[misc]
    elif name == "lying-experts":
        service.ExpertServer = LyingExperts  # type: ignore[misc]
    elif name == "lying-stage":
        service.StageServer = LyingStage  # type: ignore[misc]
    elif name == "lying-decode":
        service.StageServer = LyingDecode  # type: ignore[misc]
    else:
        raise SystemExit(f"faulty_daemon: unknown fault {fault!r}")
    print(f"faulty_daemon: {fault}", file=sys.stderr)


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
