"""Integrity at rest: stored blobs and assembled slices are checked against the manifest
when they are reused, hashed once per version of the file, and a corrupt unit stops
being held until it is downloaded again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvasird.model.distribution import ShardService
from kvasird.model.manifest import Manifest, Piece, Unit
from kvasird.model.slice import LayerWindow, verify_slice
from kvasird.model.store import CorruptPiece, ShardStore
from kvasird.model.transfer import download


def blob(store: ShardStore, piece: Piece) -> Path:
    return store.root / "blobs" / piece.sha256.hex()[:2] / piece.sha256.hex()


def flip(path: Path, offset: int, keep_mtime: bool = False) -> None:
    """Change one byte in place (same file, same size)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def reopen(store: ShardStore) -> ShardStore:
    """The same store as a restarted daemon opens it."""
    return ShardStore(store.root, store.root.parent / "state.db")


async def test_a_flipped_byte_in_a_held_blob_is_found_after_a_restart_and_downloaded_again(
        swarm, source_store, store_factory, moe_manifest):
    mid, window = moe_manifest.model_id, [Unit("layer", 0), Unit("layer", 1)]
    learner = store_factory("learner")
    await download(learner, mid, window, [swarm.add("a", source_store)], swarm.open_stream)
    piece = moe_manifest.piece("blk.1.attn_q.weight", -1)
    flip(blob(learner, piece), 100)
    with reopen(learner) as restarted:
        assert restarted.verified_held(mid, window) == [Unit("layer", 0)]
        assert restarted.held_units(mid) == [Unit("layer", 0)]  # not advertised any more
        assert not blob(restarted, piece).exists()
        report = await download(restarted, mid, window, ["a"], swarm.open_stream)
        assert report.received_bytes == piece.length
        assert restarted.held_units(mid) == window
        assert restarted.read_piece(piece)  # verified bytes again


def test_a_corrupt_blob_met_while_assembling_a_slice_is_no_longer_held(source_store, moe_manifest,
                                                                      tmp_path):
    mid = moe_manifest.model_id
    piece = moe_manifest.piece("blk.0.attn_k.weight", -1)
    flip(blob(source_store, piece), 7)
    with pytest.raises(CorruptPiece, match="download its unit again"):
        source_store.write_slice(mid, LayerWindow(0, 1, experts=False), tmp_path / "w.gguf")
    assert Unit("layer", 0) not in source_store.held_units(mid)
    assert Unit("layer", 1) in source_store.held_units(mid)


def test_a_corrupt_blob_is_not_served(source_store, moe_manifest):
    piece = moe_manifest.piece("blk.2.ffn_down_exps.weight", 3)
    flip(blob(source_store, piece), 0)
    with reopen(source_store) as restarted:
        assert restarted.read_range(moe_manifest.model_id, piece.tensor, 3, 0, 64) is None
        assert Unit("expert", 2, 3) not in restarted.held_units(moe_manifest.model_id)


def _window_store(source_store: ShardStore, manifest: Manifest) -> ShardService:
    """A node holding part of the model (slices are assembled from its blobs)."""
    source_store.drop(manifest.model_id, [Unit("expert", 2, e) for e in range(8)])
    return ShardService(None, source_store)  # type: ignore[arg-type]  # no network needed


def test_a_reused_slice_with_a_flipped_byte_is_assembled_again(source_store, moe_manifest):
    mid, units = moe_manifest.model_id, [Unit("layer", 0), Unit("layer", 1)]
    shards = _window_store(source_store, moe_manifest)
    [path] = shards.model_files(mid, units)
    good = path.read_bytes()
    flip(path, len(good) - 10)
    shards.store = reopen(source_store)
    try:
        assert shards.model_files(mid, units) == [path]
        assert path.read_bytes() == good
        verify_slice(path, moe_manifest)
    finally:
        shards.store.close()


def test_an_unchanged_file_is_not_hashed_again_after_a_restart(source_store, moe_manifest):
    """What makes a restart cheap: a file whose size, mtime and inode are those it had
    when it last hashed right is trusted (a change made behind the store's back that
    keeps all three is, by design, only found once the file changes again)."""
    mid, units = moe_manifest.model_id, [Unit("layer", 0)]
    shards = _window_store(source_store, moe_manifest)
    [path] = shards.model_files(mid, units)
    flip(path, path.stat().st_size - 10, keep_mtime=True)
    with reopen(source_store) as restarted:
        assert restarted.check_slice(mid, LayerWindow(0, 1, experts=False), path)
        os.utime(path)  # the file changes in a way a stat can see: hashed again, caught
        assert not restarted.check_slice(mid, LayerWindow(0, 1, experts=False), path)
        assert not path.exists()


def test_a_slice_file_of_another_spec_is_not_reused(source_store, moe_manifest, tmp_path):
    mid = moe_manifest.model_id
    path = source_store.write_slice(mid, LayerWindow(0, 2, experts=False), tmp_path / "s.gguf")
    assert source_store.check_slice(mid, LayerWindow(0, 2, experts=False), path)
    assert not source_store.check_slice(mid, LayerWindow(0, 1, experts=False), path)
