"""Slicing is a byte copy: read back, every slice equals the bytes of the full file."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasird.model.manifest import Manifest
from kvasird.model.slice import (
    KEY_MODEL_ID,
    KEY_SLICE,
    ExpertRange,
    HeadSlice,
    LayerWindow,
    SliceError,
    gguf_pieces,
    parse_spec,
    read_slice,
    slice_tensors,
    verify_slice,
    write_slice,
)

pytestmark = pytest.mark.slow  # a minute: slices of a K-quant MoE written and read back

_COUNTER = itertools.count()
_SETTINGS = settings(max_examples=15, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def full_tensors(moe_reader):
    """Tensor bytes of the full file as gguf-py reads them (the reference)."""
    return {t.name: t for t in moe_reader.tensors}


def _cut(moe_path, manifest, spec, tmp_path):
    out = tmp_path / f"slice{next(_COUNTER)}.gguf"
    with gguf_pieces(moe_path, manifest) as read:
        write_slice(manifest, spec, out, read)
    return out


@st.composite
def windows(draw):
    a = draw(st.integers(0, 2))
    return LayerWindow(a, draw(st.integers(a + 1, 3)), draw(st.booleans()))


@st.composite
def expert_ranges(draw):
    e0 = draw(st.integers(0, 7))
    return ExpertRange(draw(st.integers(0, 2)), e0, draw(st.integers(e0 + 1, 8)))


@_SETTINGS
@given(spec=windows())
def test_a_window_slice_reads_back_bit_identical(spec, moe_path, moe_manifest, full_tensors,
                                                 tmp_path):
    got = read_slice(_cut(moe_path, moe_manifest, spec, tmp_path))
    assert got.model_id == moe_manifest.model_id and got.spec == spec
    expected = {n for n in full_tensors if n.startswith("blk.")
                and spec.start <= int(n.split(".")[1]) < spec.stop
                and (spec.experts or "_exps" not in n)}
    assert set(got.tensors) == expected
    for name, data in got.tensors.items():
        assert data == full_tensors[name].data.tobytes()


@_SETTINGS
@given(spec=expert_ranges())
def test_an_expert_slice_is_the_slabs_of_the_k_quant_tensor(spec, moe_path, moe_manifest,
                                                            full_tensors, tmp_path):
    path = _cut(moe_path, moe_manifest, spec, tmp_path)
    got = read_slice(path)
    names = [f"blk.{spec.layer}.ffn_{w}_exps.weight" for w in ("gate", "up", "down")]
    assert sorted(got.tensors) == sorted(names)
    for name in names:
        full = full_tensors[name]
        assert full.tensor_type == GGMLQuantizationType.Q4_K
        raw = full.data.tobytes()
        bpe = len(raw) // 8
        assert got.tensors[name] == raw[spec.start * bpe:spec.stop * bpe]
        for e in range(spec.start, spec.stop):
            assert np.array_equal(full.data[e].view(np.uint8).reshape(-1),
                                  np.frombuffer(got.tensors[name], np.uint8)[
                                      (e - spec.start) * bpe:(e - spec.start + 1) * bpe])
    shapes = {t.name: [int(x) for x in t.shape] for t in GGUFReader(path).tensors}
    assert all(shapes[n][2] == spec.stop - spec.start for n in names)


def test_slices_keep_the_architecture_and_only_the_head_keeps_the_tokenizer(
        moe_path, moe_manifest, tmp_path):
    head = GGUFReader(_cut(moe_path, moe_manifest, HeadSlice(), tmp_path))
    window = GGUFReader(_cut(moe_path, moe_manifest, LayerWindow(0, 1), tmp_path))
    for r in (head, window):
        assert r.fields["general.architecture"].contents() == "qwen3moe"
        assert r.fields["qwen3moe.expert_count"].contents() == 8
        assert r.fields[KEY_MODEL_ID].contents() == moe_manifest.model_id
    assert head.fields[KEY_SLICE].contents() == "head"
    assert "tokenizer.ggml.tokens" in head.fields
    assert not any(k.startswith("tokenizer.") for k in window.fields)
    assert {t.name for t in head.tensors} == {"token_embd.weight", "output_norm.weight",
                                              "output.weight"}


def test_a_dense_model_window_has_its_ffn_and_no_experts(dense_path, tmp_path):
    manifest = Manifest.from_gguf(dense_path)
    assert manifest.n_expert == 0
    names = [t.name for t, _ in slice_tensors(manifest, LayerWindow(1, 3))]
    assert "blk.2.ffn_gate.weight" in names
    assert all(n.startswith(("blk.1.", "blk.2.")) for n in names)


def test_verify_slice_catches_a_flipped_byte(moe_path, moe_manifest, tmp_path):
    path = _cut(moe_path, moe_manifest, ExpertRange(1, 2, 4), tmp_path)
    verify_slice(path, moe_manifest)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SliceError, match="corrupt"):
        verify_slice(path, moe_manifest)


@pytest.mark.parametrize("text", ["layers=0:2", "layers=1:3,no-experts", "experts=2:0:8", "head"])
def test_slice_spec_text_round_trips(text):
    assert str(parse_spec(text)) == text


@pytest.mark.parametrize("text", ["layers=2:1", "layers=0:9", "experts=0:3:3", "experts=5:0:1",
                                  "experts=0:0:9"])
def test_out_of_range_slices_are_refused(text, moe_manifest):
    with pytest.raises(SliceError, match="block"):
        slice_tensors(moe_manifest, parse_spec(text))


def test_malformed_slice_text_says_what_to_write():
    with pytest.raises(SliceError, match="layers=A:B"):
        parse_spec("layers=1")


def test_ggml_own_gguf_parser_loads_an_expert_slice(moe_path, moe_manifest, tmp_path):
    pytest.importorskip("ggml")
    from kvasird.compute.ggufview import GGUFFile

    spec = ExpertRange(1, 2, 7)
    path = _cut(moe_path, moe_manifest, spec, tmp_path)
    loaded, ours = GGUFFile(path), read_slice(path)
    assert loaded.get("general.architecture") == "qwen3moe"
    assert loaded.get(KEY_MODEL_ID) == moe_manifest.model_id
    assert loaded.get("qwen3moe.expert_feed_forward_length") == 256
    for name, data in ours.tensors.items():
        info = loaded.info(name)
        assert info.type == GGMLQuantizationType.Q4_K and info.ne[2] == 5
        assert loaded.data(name).tobytes() == data
