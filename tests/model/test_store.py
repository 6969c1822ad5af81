"""The shard store: import, verified reads, slices from blobs, drop and garbage collection."""

from __future__ import annotations

import threading

import pytest

from kvasird.model.manifest import HEAD, Manifest, Unit
from kvasird.model.names import model_name
from kvasird.model.slice import (
    ExpertRange,
    LayerWindow,
    gguf_pieces,
    read_slice,
    verify_slice,
    write_slice,
)
from kvasird.model.store import AmbiguousName, CorruptPiece, ShardStore, StoreError


def _blob_bytes(store) -> int:
    return sum(p.stat().st_size for p in (store.root / "blobs").glob("*/*"))


def test_importing_a_gguf_holds_every_unit_once(source_store, moe_manifest):
    mid = moe_manifest.model_id
    assert source_store.held_units(mid) == sorted(moe_manifest.unit_sizes)
    distinct = {p.sha256: p.length for p in moe_manifest.all_pieces}
    assert _blob_bytes(source_store) == sum(distinct.values())
    [record] = source_store.models()
    assert (record.model_id, record.held_bytes, record.total_bytes) == (
        mid, moe_manifest.total_bytes, moe_manifest.total_bytes)


def test_importing_twice_changes_nothing(source_store, moe_path, moe_manifest):
    before = _blob_bytes(source_store)
    source_store.import_gguf(moe_path)
    assert len(source_store.models()) == 1 and _blob_bytes(source_store) == before


def test_a_slice_from_the_store_equals_a_slice_from_the_file(source_store, moe_path, moe_manifest,
                                                            tmp_path):
    spec = ExpertRange(2, 3, 7)
    from_store = source_store.write_slice(moe_manifest.model_id, spec, tmp_path / "a.gguf")
    with gguf_pieces(moe_path, moe_manifest) as read:
        from_file = write_slice(moe_manifest, spec, tmp_path / "b.gguf", read)
    assert from_store.read_bytes() == from_file.read_bytes()


def test_a_corrupted_blob_is_caught_on_load_and_deleted(source_store, moe_manifest, tmp_path):
    piece = moe_manifest.piece("blk.0.attn_q.weight", -1)
    blob = source_store.root / "blobs" / piece.sha256.hex()[:2] / piece.sha256.hex()
    data = bytearray(blob.read_bytes())
    data[100] ^= 0x40
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptPiece, match="download its unit again"):
        source_store.write_slice(moe_manifest.model_id, LayerWindow(0, 1), tmp_path / "w.gguf")
    assert not blob.exists()
    assert not (tmp_path / "w.gguf").exists()


def test_after_a_restart_a_blob_is_reverified_before_it_is_served(source_store, moe_manifest,
                                                                   tmp_path):
    piece = moe_manifest.piece("blk.1.ffn_up_exps.weight", 4)
    blob = source_store.root / "blobs" / piece.sha256.hex()[:2] / piece.sha256.hex()
    blob.write_bytes(bytes(piece.length))
    with ShardStore(source_store.root, tmp_path / "source" / "state.db") as restarted:
        assert restarted.read_range(moe_manifest.model_id, piece.tensor, 4, 0, 16) is None
        assert not blob.exists()
        assert Unit("expert", 1, 4) not in restarted.held_units(moe_manifest.model_id)


def test_a_slice_not_held_is_refused(store_factory, moe_manifest, tmp_path):
    store = store_factory("empty")
    store.add_manifest(moe_manifest)
    with pytest.raises(StoreError, match="not held here"):
        store.write_slice(moe_manifest.model_id, ExpertRange(0, 0, 1), tmp_path / "x.gguf")


def test_dropping_units_frees_only_their_pieces(source_store, moe_manifest, tmp_path):
    mid = moe_manifest.model_id
    before = _blob_bytes(source_store)
    experts = [Unit("expert", 1, e) for e in range(8)]
    freed = source_store.drop(mid, experts)
    assert freed == sum(moe_manifest.unit_sizes[u] for u in experts)
    assert _blob_bytes(source_store) == before - freed
    assert Unit("expert", 1, 0) not in source_store.held_units(mid)
    out = source_store.write_slice(mid, LayerWindow(1, 2, experts=False), tmp_path / "w.gguf")
    assert read_slice(out).model_id == mid


def test_dropping_the_model_leaves_no_bytes(source_store, moe_manifest):
    source_store.drop_model(moe_manifest.model_id)
    assert _blob_bytes(source_store) == 0
    assert source_store.models() == []
    assert source_store.gc() == 0


def test_gc_deletes_orphaned_partial_downloads(source_store):
    orphan = source_store.root / "partial" / (("ab" * 32) + ".part")
    orphan.write_bytes(b"x" * 1000)
    assert source_store.gc() == 1000 and not orphan.exists()


def test_models_resolve_by_name_or_id_prefix(source_store, moe_manifest):
    mid = moe_manifest.model_id
    [record] = source_store.models()
    assert source_store.resolve(record.name) == mid
    assert source_store.resolve(mid[:8]) == mid
    with pytest.raises(StoreError, match="no model"):
        source_store.resolve("nothing-like-it")


def test_a_model_is_found_by_its_name_slug_id_or_a_prefix_of_8_hex_digits(store_factory,
                                                                           moe_path):
    store = store_factory("named")
    mid = store.import_gguf(moe_path, "tiny:q3").model_id
    for text in ("tiny:q3", "TINY:Q3", "tiny-q3", mid, mid[:8]):
        assert store.resolve(text) == mid
    with pytest.raises(StoreError, match="no model here is named 'tiny'.*64 hex digits"):
        store.resolve("tiny")
    with pytest.raises(StoreError, match="no model here"):
        store.resolve(mid[:7])


def test_a_name_two_models_claim_is_refused_with_both_ids(store_factory, moe_path,
                                                          dense_path):
    store = store_factory("twins")
    ids = sorted(store.import_gguf(p, "tiny:q3").model_id for p in (moe_path, dense_path))
    with pytest.raises(AmbiguousName) as err:
        store.resolve("tiny:q3")
    assert all(mid in str(err.value) for mid in ids) and "give the model id" in str(err.value)
    assert store.resolve(ids[0]) == ids[0]


def test_an_imported_model_keeps_its_chosen_name_and_a_fetched_one_adopts(store_factory,
                                                                          moe_path,
                                                                          dense_path):
    store = store_factory("names")
    chosen = store.import_gguf(moe_path, "tiny:q3").model_id
    store.import_gguf(moe_path)  # the daemon importing its [market] model again
    store.adopt_name(chosen, "other:name")
    assert store.name_claim(chosen) == ("tiny:q3", True)
    fetched = Manifest.from_gguf(dense_path)
    store.add_manifest(fetched)
    derived, by_choice = store.name_claim(fetched.model_id)
    assert (derived, by_choice) == (model_name(dict(_meta(fetched))), False)
    store.adopt_name(fetched.model_id, "smollm2:135m-instruct")
    assert store.name_claim(fetched.model_id) == ("smollm2:135m-instruct", False)
    assert store.name_claim("ab" * 32) == ("", False)


def test_a_model_the_network_renamed_is_still_found_by_its_former_name(store_factory,
                                                                      moe_manifest):
    store = store_factory("renamed")
    store.add_manifest(moe_manifest)
    store.adopt_name(moe_manifest.model_id, "smollm2:135m-instruct")
    store.adopt_name(moe_manifest.model_id, "tiny:q3")
    for text in ("tiny:q3", "smollm2:135m-instruct"):
        assert store.resolve(text) == moe_manifest.model_id
    store.drop_model(moe_manifest.model_id)
    with pytest.raises(StoreError, match="no model here"):
        store.resolve("smollm2:135m-instruct")


def test_a_name_from_before_names_were_family_colon_tag_is_replaced(store_factory, moe_path,
                                                                    moe_manifest):
    store = store_factory("legacy")
    store.import_gguf(moe_path, "My Old Name")
    assert store.name_claim(moe_manifest.model_id) == ("", False)  # never announced so
    store.import_gguf(moe_path)
    assert store.name_claim(moe_manifest.model_id) == (
        model_name(dict(_meta(moe_manifest)), moe_path.name), True)


def _meta(manifest: Manifest):
    return ((key, value) for key, _, value in manifest.metadata)


def test_an_expert_unit_needs_all_its_slabs_to_be_held(store_factory, moe_manifest):
    store = store_factory("partial")
    store.add_manifest(moe_manifest)
    with pytest.raises(StoreError, match="missing"):
        store.mark_held(moe_manifest.model_id, [HEAD])


def test_the_same_slice_assembled_by_two_threads_at_once_is_written_whole(
        source_store, moe_manifest, tmp_path):
    """The loader and the gateway may both need the head slice at start-up."""
    (tmp_path / "slices").mkdir()
    path = tmp_path / "slices" / "head.gguf"
    errors: list[BaseException] = []

    def write() -> None:
        try:
            source_store.write_slice(moe_manifest.model_id, LayerWindow(0, 2), path)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    verify_slice(path, moe_manifest)
    assert [p.name for p in path.parent.iterdir()] == ["head.gguf"]  # no temporary files left
