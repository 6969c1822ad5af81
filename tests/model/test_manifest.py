"""Manifests and model ids: what gguf-py sees, stable ids, validation of peer-supplied bytes."""

from __future__ import annotations

import hashlib
import shutil
import time

import msgpack
import pytest

from kvasird.model import bundled
from kvasird.model.gguffile import GGUFFormatError, read_header
from kvasird.model.manifest import HEAD, Manifest, ManifestError, Unit


def test_header_reader_agrees_with_gguf_py(moe_path, moe_reader):
    ours, theirs = read_header(moe_path), moe_reader
    assert ours.data_offset == theirs.data_offset
    base = ours.data_offset
    assert [(t.name, t.ggml_type, t.ne, base + t.offset, t.length) for t in ours.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(x) for x in t.shape), t.data_offset, t.n_bytes)
        for t in theirs.tensors]
    meta = {k: v for k, _, v in ours.metadata}
    assert meta["general.architecture"] == b"qwen3moe"
    assert meta["qwen3moe.expert_count"] == theirs.fields["qwen3moe.expert_count"].contents()
    tokens = meta["tokenizer.ggml.tokens"][1]
    assert [t.decode() for t in tokens[:50]] == theirs.fields[
        "tokenizer.ggml.tokens"].contents()[:50]


def test_tensor_and_slab_hashes_are_sha256_of_the_file_bytes(moe_reader, moe_manifest):
    up = next(t for t in moe_reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    entry = moe_manifest.tensor("blk.1.ffn_up_exps.weight")
    assert entry.sha256 == hashlib.sha256(up.data.tobytes()).digest()
    assert [s for s, _ in entry.slabs] == [hashlib.sha256(up.data[e].tobytes()).digest()
                                          for e in range(8)]


def test_model_id_is_stable_and_any_changed_byte_changes_it(moe_path, moe_manifest, tmp_path):
    assert Manifest.from_gguf(moe_path).model_id == moe_manifest.model_id
    copy = tmp_path / "flipped.gguf"
    shutil.copyfile(moe_path, copy)
    entry = moe_manifest.tensor("blk.2.ffn_down_exps.weight")
    at = read_header(moe_path).data_offset + entry.offset + 5 * entry.slab_length + 7
    with open(copy, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    other = Manifest.from_gguf(copy)
    assert other.model_id != moe_manifest.model_id
    changed = [p for p, q in zip(other.all_pieces, moe_manifest.all_pieces, strict=True)
               if p.sha256 != q.sha256]
    assert [(p.tensor, p.expert) for p in changed] == [("blk.2.ffn_down_exps.weight", 5)]


def test_manifest_round_trips_through_its_canonical_bytes(moe_manifest):
    again = Manifest.from_bytes(moe_manifest.raw, moe_manifest.model_id)
    assert again == moe_manifest
    assert again.raw == moe_manifest.raw


def test_manifest_bytes_that_do_not_hash_to_the_id_are_rejected(moe_manifest):
    with pytest.raises(ManifestError, match="do not hash"):
        Manifest.from_bytes(moe_manifest.raw, "0" * 64)


def test_manifest_with_a_lying_tensor_length_is_rejected(moe_manifest):
    doc = msgpack.unpackb(moe_manifest.raw)
    doc["tensors"][3]["length"] += 1
    with pytest.raises(ManifestError, match="does not match its type and shape"):
        Manifest.from_bytes(msgpack.packb(doc))


def test_manifest_in_non_canonical_form_is_rejected(moe_manifest):
    doc = msgpack.unpackb(moe_manifest.raw)
    reordered = {k: doc[k] for k in reversed(list(doc))}
    with pytest.raises(ManifestError, match="canonical"):
        Manifest.from_bytes(msgpack.packb(reordered))


def test_units_partition_every_tensor_byte(moe_manifest):
    sizes = moe_manifest.unit_sizes
    assert sum(sizes.values()) == moe_manifest.total_bytes
    experts = [s for u, s in sizes.items() if u.kind == "expert"]
    assert len(experts) == 3 * 8 and len(set(experts)) == 1
    assert {u for u in sizes if u.kind == "layer"} == {Unit("layer", i) for i in range(3)}
    head = {p.tensor for p in moe_manifest.pieces([HEAD])}
    assert head == {"token_embd.weight", "output_norm.weight", "output.weight"}
    assert all(p.unit.kind == "expert" for p in moe_manifest.pieces() if "_exps" in p.tensor)


def test_a_llama_file_with_experts_is_held_in_expert_units(tmp_path):
    """Mixtral's layout: general.architecture llama, experts as stacked _exps tensors."""
    from kvasird_dev.testmodels import make_model

    m = Manifest.from_gguf(make_model(tmp_path / "mixtral.gguf", arch="mixtral", n_layer=2,
                                      n_expert=4, n_expert_used=2))
    assert (m.arch, m.n_layer, m.n_expert) == ("llama", 2, 4)
    sizes = m.unit_sizes
    assert sum(sizes.values()) == m.total_bytes
    assert {u for u in sizes if u.kind == "expert"} == {Unit("expert", layer, e)
                                                        for layer in range(2) for e in range(4)}
    layer = {p.tensor for p in m.pieces([Unit("layer", 1)])}
    assert "blk.1.ffn_gate_inp.weight" in layer and not any("_exps" in t for t in layer)


def test_long_pieces_carry_chunk_hashes(moe_manifest):
    embd = moe_manifest.piece("token_embd.weight", -1)
    spans = embd.spans(moe_manifest.chunk_size)
    assert len(spans) == -(-embd.length // moe_manifest.chunk_size) > 1
    assert sum(n for _, n, _ in spans) == embd.length


def test_unit_text_round_trips_and_rejects_garbage():
    for u in (HEAD, Unit("layer", 3), Unit("expert", 2, 7)):
        assert Unit.parse(str(u)) == u
    with pytest.raises(ManifestError, match="layer:I"):
        Unit.parse("layers:3")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        Manifest.from_gguf(bad)


def test_bundled_model_hashes_in_under_a_second_or_so():
    try:
        path = bundled.bundled_path(fetch=False)
    except bundled.BundledModelError:
        pytest.skip("bundled model not fetched (kvasird model add bundled:smollm2)")
    t = time.perf_counter()
    manifest = Manifest.from_gguf(path)
    elapsed = time.perf_counter() - t
    assert manifest.n_layer == 30 and manifest.arch == "llama"
    assert elapsed < 2.0, f"hashing 98 MB took {elapsed:.2f} s"


def test_a_truncated_gguf_says_to_fetch_it_again(moe_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(moe_path.read_bytes()[:-1000])
    with pytest.raises(GGUFFormatError, match="fetch it again"):
        Manifest.from_gguf(cut)
