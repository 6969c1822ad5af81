"""The shard protocol over in-memory streams, with real stores and the real server."""

from __future__ import annotations

import hashlib

import pytest
import trio
from structlog.testing import capture_logs
from trio.testing import memory_stream_pair

from kvasird.model.manifest import HEAD, Unit
from kvasird.model.slice import LayerWindow, gguf_pieces, units_of, write_slice
from kvasird.model.store import ShardStore
from kvasird.model.transfer import (
    MAX_READ,
    TransferError,
    download,
    ensure_manifest,
    fetch_manifest,
    serve_shards,
)
from kvasird.wire.framing import FrameReader, write_frame

from .conftest import MemoryStream


class FlippingSource:
    """A holder that serves the right pieces with one byte in each flipped."""

    def __init__(self, store: ShardStore) -> None:
        self._store = store

    def manifest_bytes(self, model_id: str) -> bytes | None:
        return self._store.manifest_bytes(model_id)

    def read_range(self, model_id, tensor, expert, offset, length):
        data = self._store.read_range(model_id, tensor, expert, offset, length)
        return None if data is None else bytes([data[0] ^ 1]) + data[1:]


def _size(manifest, units) -> int:
    return sum({p.sha256: p.length for p in manifest.pieces(units)}.values())


async def test_a_window_download_fetches_only_that_window_and_slices_identically(
        swarm, source_store, store_factory, moe_manifest, moe_path, tmp_path):
    mid = moe_manifest.model_id
    swarm.add("a", source_store)
    client = store_factory("client")
    spec = LayerWindow(1, 3, experts=False)
    manifest = await ensure_manifest(client, mid, ["a"], swarm.open_stream)
    units = units_of(manifest, spec)
    seen = []
    report = await download(client, mid, units, ["a"], swarm.open_stream, progress=seen.append)
    want = _size(moe_manifest, units)
    assert report.total_bytes == report.received_bytes == want
    assert want < moe_manifest.total_bytes / 50
    manifest_len = len(moe_manifest.raw)
    assert want + manifest_len <= swarm.sent["a"] <= want + manifest_len + 4096
    assert client.held_units(mid) == sorted(units)
    assert seen[-1].done_bytes == seen[-1].total_bytes == want and seen[-1].eta_s == 0.0
    assert seen[-1].rate > 0
    ours = client.write_slice(mid, spec, tmp_path / "ours.gguf")
    with gguf_pieces(moe_path, moe_manifest) as read:
        reference = write_slice(moe_manifest, spec, tmp_path / "ref.gguf", read)
    assert ours.read_bytes() == reference.read_bytes()


async def test_parallel_holders_share_a_download(swarm, source_store, store_factory,
                                                 moe_path, moe_manifest):
    others = [store_factory(n) for n in ("b", "c")]
    for s in others:
        s.import_gguf(moe_path)
    for name, s in zip("abc", [source_store, *others], strict=True):
        swarm.add(name, s)
    client = store_factory("client")
    await download(client, moe_manifest.model_id, None, list("abc"), swarm.open_stream,
                   batch_bytes=1 << 20)
    assert all(swarm.sent[n] > 1 << 20 for n in "abc")
    total = _size(moe_manifest, None)
    assert total <= sum(swarm.sent.values()) <= total + 3 * len(moe_manifest.raw) + 65536
    assert client.held_units(moe_manifest.model_id) == sorted(moe_manifest.unit_sizes)


async def test_a_holder_dying_mid_transfer_hands_over_to_another(swarm, source_store,
                                                                 store_factory, moe_path,
                                                                 moe_manifest):
    backup = store_factory("backup")
    backup.import_gguf(moe_path)
    swarm.add("dies", source_store, die_after=6 << 20)
    swarm.add("backup", backup)
    client = store_factory("client")
    client.add_manifest(moe_manifest)
    report = await download(client, moe_manifest.model_id, [HEAD], ["dies", "backup"],
                            swarm.open_stream, retries=1)
    assert "dies" in swarm.dead
    assert report.received_bytes == report.total_bytes == moe_manifest.unit_sizes[HEAD]
    assert client.held_units(moe_manifest.model_id) == [HEAD]


async def test_an_interrupted_download_resumes_from_verified_partial_chunks(
        swarm, source_store, store_factory, moe_path, moe_manifest):
    mid = moe_manifest.model_id
    swarm.add("dies", source_store, die_after=11 << 20)
    client = store_factory("client")
    with pytest.raises(TransferError, match="run it again"):
        await download(client, mid, [HEAD], ["dies"], swarm.open_stream, retries=1)
    assert list((client.root / "partial").glob("*.part"))
    backup = store_factory("backup")
    backup.import_gguf(moe_path)
    swarm.add("backup", backup)
    report = await download(client, mid, [HEAD], ["backup"], swarm.open_stream)
    assert report.resumed_bytes >= 8 << 20
    assert report.received_bytes == report.total_bytes - report.resumed_bytes
    assert client.held_units(mid) == [HEAD]
    assert not list((client.root / "partial").glob("*.part"))


async def test_a_holder_flipping_bytes_is_detected_logged_and_avoided(
        swarm, source_store, store_factory, moe_path, moe_manifest):
    honest = store_factory("honest")
    honest.import_gguf(moe_path)
    swarm.add("liar", FlippingSource(source_store))
    swarm.add("honest", honest)
    client = store_factory("client")
    client.add_manifest(moe_manifest)
    with capture_logs() as logs:
        report = await download(client, moe_manifest.model_id, None, ["liar", "honest"],
                                swarm.open_stream)
    assert report.bad_holders == ("liar",)
    assert report.rejected_bytes > 0
    assert report.received_bytes == report.total_bytes + report.rejected_bytes
    assert any(e["event"].startswith("shard holder sent wrong bytes") and e["peer"] == "liar"
               for e in logs)
    assert client.held_units(moe_manifest.model_id) == sorted(moe_manifest.unit_sizes)


async def test_only_lying_holders_means_nothing_wrong_is_kept(swarm, source_store, store_factory,
                                                              moe_manifest):
    swarm.add("liar", FlippingSource(source_store))
    client = store_factory("client")
    units = [Unit("expert", 0, e) for e in range(8)]
    with pytest.raises(TransferError, match="bad: liar"):
        await download(client, moe_manifest.model_id, units, ["liar"], swarm.open_stream)
    assert not list((client.root / "blobs").glob("*/*"))
    assert client.held_units(moe_manifest.model_id) == []


async def test_a_silent_holder_times_out_and_the_others_finish(swarm, source_store, store_factory,
                                                               moe_manifest, mock_clock):
    mock_clock.autojump_threshold = 0.01  # progress ticks (0.25 s) bound each jump
    swarm.add("silent", source_store)
    swarm.silent.add("silent")
    swarm.add("a", source_store)
    client = store_factory("client")
    client.add_manifest(moe_manifest)
    units = [Unit("layer", 0), Unit("layer", 1)]
    report = await download(client, moe_manifest.model_id, units, ["silent", "a"],
                            swarm.open_stream, stall_timeout=30, retries=0,
                            batch_bytes=16 << 10)
    assert report.received_bytes == _size(moe_manifest, units)
    assert report.seconds >= 30


async def test_a_manifest_that_does_not_match_the_id_is_skipped(swarm, source_store, store_factory,
                                                                dense_path, moe_manifest):
    other = store_factory("other")
    dense = other.import_gguf(dense_path)

    class Impostor:
        def manifest_bytes(self, model_id):
            return dense.raw

        def read_range(self, *args):
            return None

    swarm.add("impostor", Impostor())
    swarm.add("a", source_store)
    with capture_logs() as logs:
        got = await fetch_manifest(swarm.open_stream, ["impostor", "a"], moe_manifest.model_id)
    assert got == moe_manifest
    assert any(e["event"] == "holder sent a bad manifest" for e in logs)


async def test_server_refuses_a_read_larger_than_the_limit_and_keeps_serving(source_store,
                                                                             moe_manifest):
    client, server = memory_stream_pair()
    ours = MemoryStream(client)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_shards, MemoryStream(server), source_store)
        reader = FrameReader(ours)
        await write_frame(ours, {"op": "read", "model": moe_manifest.model_id,
                                 "ranges": [["token_embd.weight", -1, 0, MAX_READ + 1]]})
        assert "more than" in (await reader.read())["error"]
        piece = moe_manifest.piece("output_norm.weight", -1)
        await write_frame(ours, {"op": "read", "model": moe_manifest.model_id,
                                 "ranges": [[piece.tensor, -1, 0, piece.length]]})
        header = await reader.read()
        assert header == {"ok": True, "len": piece.length}
        data = b""
        while len(data) < piece.length:
            data += await ours.read(piece.length - len(data))
        assert hashlib.sha256(data).digest() == piece.sha256
        await ours.close()


async def test_pieces_a_holder_lacks_come_from_the_holders_that_have_them(
        swarm, source_store, store_factory, moe_path, moe_manifest):
    mid = moe_manifest.model_id
    partial = store_factory("partial")
    partial.import_gguf(moe_path)
    partial.drop(mid, [u for u in moe_manifest.unit_sizes if u.kind == "expert"])
    swarm.add("partial", partial)
    swarm.add("full", source_store)
    client = store_factory("client")
    client.add_manifest(moe_manifest)
    with capture_logs() as logs:
        report = await download(client, mid, None, ["partial", "full"], swarm.open_stream,
                                batch_bytes=256 << 10)
    assert any(e["event"].startswith("holder lacks pieces") and e["peer"] == "partial"
               for e in logs)
    assert report.received_bytes == report.total_bytes and not report.bad_holders
    assert swarm.sent["partial"] > 0
    assert client.held_units(mid) == sorted(moe_manifest.unit_sizes)


async def test_server_hangs_up_on_a_request_that_is_not_a_shard_request(source_store):
    client, server = memory_stream_pair()
    ours = MemoryStream(client)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_shards, MemoryStream(server), source_store)
        await write_frame(ours, ["not", "a", "map"])
        assert "model id" in (await FrameReader(ours).read())["error"]
        await ours.write(b"\xff\xff\xff\xff")  # a 4 GiB frame announced
        with trio.fail_after(5):
            assert await ours.read(100) == b""
