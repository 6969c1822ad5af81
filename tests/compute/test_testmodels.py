"""Generated test models: real llama.cpp metadata, deterministic, readable by ggml's loader."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from kvasird.cli import main
from kvasird.compute.ggufview import GGUFFile
from kvasird.model.testmodels import DTYPES, TestModelError, bundled_tokenizer, make_model
from kvasird.numerics.oracle import Oracle

UP = "blk.0.ffn_up_exps.weight"


def _fields(path):
    f = GGUFFile(path)
    return f, f.metadata


def test_same_seed_gives_identical_bytes(tmp_path):
    a = make_model(tmp_path / "a.gguf", dtype="q8_0", seed=3)
    b = make_model(tmp_path / "b.gguf", dtype="q8_0", seed=3)
    c = make_model(tmp_path / "c.gguf", dtype="q8_0", seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_qwen3moe_carries_llama_cpp_keys_and_tensor_shapes(tmp_path):
    path = make_model(tmp_path / "m.gguf", n_layer=3, n_embd=64, n_head=4, n_head_kv=2,
                      head_dim=16, n_expert=8, n_expert_used=2, n_ff_exp=32)
    reader, kv = _fields(path)
    assert kv["general.architecture"] == "qwen3moe"
    assert kv["qwen3moe.block_count"] == 3
    assert kv["qwen3moe.expert_count"] == 8
    assert kv["qwen3moe.expert_used_count"] == 2
    assert kv["qwen3moe.expert_feed_forward_length"] == 32
    assert kv["qwen3moe.attention.key_length"] == kv["qwen3moe.attention.value_length"] == 16
    ne = {name: list(t.ne) for name, t in reader.tensors.items()}
    assert ne["blk.2.ffn_gate_inp.weight"] == [64, 8]
    assert ne["blk.2.ffn_up_exps.weight"] == [64, 32, 8]
    assert ne["blk.2.ffn_down_exps.weight"] == [32, 64, 8]
    assert ne["blk.0.attn_q_norm.weight"] == [16]
    assert ne["output.weight"] == ne["token_embd.weight"]


def test_llama_is_tied_and_dense(tmp_path):
    reader, kv = _fields(make_model(tmp_path / "l.gguf", arch="llama", n_layer=1))
    names = set(reader.tensors)
    assert kv["general.architecture"] == "llama"
    assert "output.weight" not in names
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= names
    assert not any("exps" in n or "q_norm" in n for n in names)


def test_tokenizer_is_the_bundled_one_and_gguf_py_reads_it(tmp_path, bundled):
    reader = GGUFReader(make_model(tmp_path / "m.gguf", n_layer=1))
    ref = bundled_tokenizer()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert tokens == ref["tokenizer.ggml.tokens"][2]
    assert len(tokens) == reader.fields["qwen3moe.vocab_size"].contents()
    assert reader.fields["tokenizer.ggml.merges"].contents() == ref["tokenizer.ggml.merges"][2]
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert int(embd.shape[1]) == len(tokens)


QUANTIZED_DIMS = dict(n_layer=1, n_embd=256, head_dim=64, n_ff_exp=256, tied_output=True)


@pytest.fixture(scope="module")
def f32_up(tmp_path_factory):
    """The f32 model's UP weights, which every quantized file is compared with."""
    path = make_model(tmp_path_factory.mktemp("f32") / "f.gguf", dtype="f32", **QUANTIZED_DIMS)
    return Oracle(path).w(UP)


@pytest.mark.parametrize("dtype, tol", [("f16", 2e-3), ("q8_0", 2e-2), ("q4_k", 0.2)])
def test_quantized_file_holds_the_same_weights_as_f32(tmp_path, f32_up, dtype, tol):
    want = f32_up
    got = Oracle(make_model(tmp_path / "q.gguf", dtype=dtype, **QUANTIZED_DIMS))
    assert got.file.info(UP).type == DTYPES[dtype]
    assert np.abs(got.w(UP) - want).max() < tol * np.abs(want).max()


@pytest.mark.parametrize("dims", [dict(dtype="q8_0", n_embd=48), dict(dtype="q4_k", n_embd=64),
                                  dict(n_head=4, n_head_kv=3), dict(n_expert_used=9),
                                  dict(arch="gpt9"), dict(dtype="q3_z")])
def test_impossible_dimensions_raise_a_clear_error(tmp_path, dims):
    with pytest.raises(TestModelError):
        make_model(tmp_path / "x.gguf", **dims)


def test_cli_writes_a_model(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["dev", "make-model", str(out), "--arch", "llama", "--dtype", "q8_0",
                 "--layers", "1"]) == 0
    _, kv = _fields(out)
    assert kv["llama.block_count"] == 1
    assert str(out) in capsys.readouterr().out
