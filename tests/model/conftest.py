"""Model fixtures: generated GGUFs (built once per session) and an in-memory swarm of holders."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import trio
from gguf import GGUFReader
from trio.testing import memory_stream_pair

from kvasird.errors import PeerError
from kvasird.model.manifest import Manifest
from kvasird.model.store import ShardStore
from kvasird.model.transfer import ShardSource, serve_shards
from kvasird_dev.testmodels import make_model

MOE_DIMS = {"n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64,
            "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 256, "dtype": "q4_k"}
"""A K-quant qwen3moe: 13 MB Q8_0 embedding (4 chunks), 8 experts of 3 × 36 KB per layer."""


@pytest.fixture(scope="session")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "moe.gguf", "qwen3moe", **MOE_DIMS)


@pytest.fixture(scope="session")
def dense_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "dense.gguf", "llama", n_layer=4,
                      dtype="q8_0")


@pytest.fixture(scope="session")
def moe_reader(moe_path: Path) -> GGUFReader:
    """gguf-py's view of the full file: the reference (parsing it takes ~2 s, so once)."""
    return GGUFReader(moe_path)


@pytest.fixture(scope="session")
def moe_manifest(moe_path: Path) -> Manifest:
    return Manifest.from_gguf(moe_path)


@pytest.fixture
def store_factory(tmp_path: Path):
    stores: list[ShardStore] = []

    def make(name: str) -> ShardStore:
        root = tmp_path / name
        root.mkdir()
        stores.append(ShardStore(root / "shards", root / "state.db"))
        return stores[-1]

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def source_store(store_factory, moe_path: Path) -> ShardStore:
    store = store_factory("source")
    store.import_gguf(moe_path)
    return store


class MemoryStream:
    """One end of a trio in-memory stream with the read/write/close of a libp2p stream."""

    def __init__(self, stream: trio.abc.Stream, budget: int | None = None,
                 on_death: object = None) -> None:
        self._stream = stream
        self.written = 0
        self._budget = budget
        self._on_death = on_death

    async def read(self, n: int | None = None) -> bytes:
        try:
            return await self._stream.receive_some(n)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def write(self, data: bytes) -> None:
        if self._budget is not None and self.written + len(data) > self._budget:
            keep = max(0, self._budget - self.written)
            await self._stream.send_all(data[:keep])
            self.written += keep
            self._on_death()  # type: ignore[operator]
            await self._stream.aclose()
            raise trio.BrokenResourceError("holder died")
        await self._stream.send_all(data)
        self.written += len(data)

    async def close(self) -> None:
        await self._stream.aclose()


class Swarm:
    """Holders reachable by name over in-memory streams, each served by the real server."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.sources: dict[str, ShardSource] = {}
        self.sent: Counter[str] = Counter()
        self.dead: set[str] = set()
        self.die_after: dict[str, int] = {}
        self.silent: set[str] = set()

    def add(self, name: str, source: ShardSource, die_after: int | None = None) -> str:
        self.sources[name] = source
        if die_after is not None:
            self.die_after[name] = die_after
        return name

    async def open_stream(self, peer: str) -> MemoryStream:
        if peer in self.dead:
            raise PeerError(f"{peer} is unreachable")
        client, server = memory_stream_pair()
        budget = self.die_after.get(peer)
        if budget is not None:
            budget -= self.sent[peer]
        end = _Counting(server, self, peer, budget)
        if peer not in self.silent:
            self._nursery.start_soon(serve_shards, end, self.sources[peer])
        return MemoryStream(client)


class _Counting(MemoryStream):
    def __init__(self, stream: trio.abc.Stream, swarm: Swarm, peer: str,
                 budget: int | None) -> None:
        super().__init__(stream, budget, lambda: swarm.dead.add(peer))
        self._swarm, self._peer = swarm, peer

    async def write(self, data: bytes) -> None:
        before = self.written
        try:
            await super().write(data)
        finally:
            self._swarm.sent[self._peer] += self.written - before


@pytest.fixture
async def swarm():
    async with trio.open_nursery() as nursery:
        yield Swarm(nursery)
        nursery.cancel_scope.cancel()
