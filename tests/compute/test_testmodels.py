"""Generated test models: real llama.cpp metadata, deterministic, readable by ggml's loader."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from kvasird.compute.ggufview import GGUFFile
from kvasird.numerics.oracle import Oracle
from kvasird_dev.cli import main
from kvasird_dev.testmodels import DTYPES, TestModelError, bundled_tokenizer, make_model

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


def test_qwen3_is_dense_with_qk_norms_and_qwen3_keys(tmp_path):
    reader, kv = _fields(make_model(tmp_path / "q.gguf", arch="qwen3", n_layer=2, n_ff=96))
    assert kv["general.architecture"] == "qwen3"
    assert kv["qwen3.feed_forward_length"] == 96
    assert kv["qwen3.attention.key_length"] == kv["qwen3.attention.value_length"] == 16
    assert not any(k.startswith("qwen3.expert") for k in kv)
    ne = {name: list(t.ne) for name, t in reader.tensors.items()}
    assert ne["blk.1.attn_q_norm.weight"] == ne["blk.1.attn_k_norm.weight"] == [16]
    assert ne["blk.1.ffn_gate.weight"] == [64, 96] and ne["blk.1.ffn_down.weight"] == [96, 64]
    assert "output.weight" in ne and not any("exps" in n or "gate_inp" in n for n in ne)


def test_mixtral_is_a_llama_file_with_experts_sized_by_feed_forward_length(tmp_path):
    reader, kv = _fields(make_model(tmp_path / "x.gguf", arch="mixtral", n_layer=2, n_expert=4,
                                    n_expert_used=2, n_ff_exp=64, n_ff=999))
    assert kv["general.architecture"] == "llama"
    assert (kv["llama.expert_count"], kv["llama.expert_used_count"]) == (4, 2)
    assert kv["llama.feed_forward_length"] == 64 and kv["llama.rope.dimension_count"] == 16
    assert "llama.expert_feed_forward_length" not in kv
    ne = {name: list(t.ne) for name, t in reader.tensors.items()}
    assert ne["blk.1.ffn_gate_inp.weight"] == [64, 4]
    assert ne["blk.1.ffn_gate_exps.weight"] == [64, 64, 4]
    assert ne["blk.1.ffn_down_exps.weight"] == [64, 64, 4]
    assert "output.weight" in ne
    assert not any(n.endswith(("ffn_gate.weight", "ffn_up.weight", "q_norm.weight")) for n in ne)


def test_gemma3_carries_its_window_and_extra_norms(tmp_path):
    reader, kv = _fields(make_model(tmp_path / "g.gguf", arch="gemma3", n_layer=2,
                                    sliding_window=8, swa_pattern=3, logit_softcap=30.0))
    assert kv["general.architecture"] == "gemma3"
    assert kv["gemma3.attention.sliding_window"] == 8
    assert kv["gemma3.attention.sliding_window_pattern"] == 3
    assert kv["gemma3.final_logit_softcapping"] == 30.0
    assert kv["gemma3.rope.freq_base"] != kv["gemma3.rope.freq_base_swa"]
    names = set(reader.tensors)
    assert {"blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight",
            "blk.1.attn_q_norm.weight", "blk.1.ffn_gate.weight"} <= names
    assert "output.weight" not in names


def test_gpt_oss_carries_yarn_windows_sinks_biases_and_mxfp4_experts(tmp_path):
    f, kv = _fields(make_model(tmp_path / "o.gguf", arch="gpt-oss", n_layer=2, dtype="q8_0",
                               expert_dtype="mxfp4"))
    assert kv["general.architecture"] == "gpt-oss"
    assert kv["gpt-oss.attention.sliding_window"] == 4
    assert "gpt-oss.attention.sliding_window_pattern" not in kv  # llama.cpp's default, 2
    assert kv["gpt-oss.rope.scaling.type"] == "yarn"
    assert (kv["gpt-oss.rope.scaling.factor"],
            kv["gpt-oss.rope.scaling.original_context_length"]) == (32.0, 128)
    assert (kv["gpt-oss.expert_count"], kv["gpt-oss.expert_feed_forward_length"]) == (8, 32)
    t = f.tensors
    assert list(t["blk.1.attn_sinks.weight"].ne) == [4]
    assert list(t["blk.1.ffn_gate_exps.bias"].ne) == [32, 8]
    assert list(t["blk.1.ffn_down_exps.bias"].ne) == [64, 8]
    assert {n for n in t if n.startswith("blk.1.") and n.endswith(".bias")} == {
        f"blk.1.{n}.bias" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp",
                                    "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    assert t["blk.1.ffn_up_exps.weight"].type == DTYPES["mxfp4"]
    assert t["blk.1.attn_q.weight"].type == DTYPES["q8_0"]
    assert "output.weight" in t and "blk.1.ffn_norm.weight" not in t


def test_qwen35moe_carries_delta_net_and_shared_expert_keys_and_tensors(tmp_path):
    f, kv = _fields(make_model(tmp_path / "h.gguf", arch="qwen35moe", n_layer=4,
                               full_attention_interval=2))
    assert kv["general.architecture"] == "qwen35moe"
    assert (kv["qwen35moe.full_attention_interval"], kv["qwen35moe.rope.dimension_count"]) == (2, 8)
    assert f.numbers("qwen35moe.rope.dimension_sections") == (2, 1, 1, 0)
    ssm = ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")
    assert [kv[f"qwen35moe.ssm.{k}"] for k in ssm] == [4, 16, 2, 4, 64]
    assert kv["qwen35moe.expert_shared_feed_forward_length"] == 32
    names = set(f.tensors)
    assert {"blk.0.attn_qkv.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias",
            "blk.2.ssm_conv1d.weight", "blk.1.attn_q.weight", "blk.3.attn_q_norm.weight",
            "blk.1.ffn_gate_inp_shexp.weight", "blk.0.post_attention_norm.weight"} <= names
    assert not {"blk.1.attn_qkv.weight", "blk.0.attn_q.weight", "blk.0.ffn_norm.weight"} & names
    assert list(f.tensors["blk.1.attn_q.weight"].ne) == [64, 2 * 4 * 16]  # query and gate
    assert list(f.tensors["blk.0.ssm_conv1d.weight"].ne) == [4, 16 * (2 * 2 + 4)]
    dense = make_model(tmp_path / "d.gguf", arch="qwen35", n_layer=2)
    assert "blk.0.ffn_up.weight" in GGUFFile(dense).tensors


@pytest.mark.slow
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
                                  dict(arch="gpt9"), dict(dtype="q3_z"),
                                  dict(arch="mixtral", n_expert_used=9),
                                  dict(arch="mixtral", dtype="q8_0", n_ff_exp=48),
                                  dict(arch="qwen3", dtype="q8_0", n_ff=48),
                                  dict(arch="gemma3", sliding_window=0),
                                  dict(arch="qwen35", ssm_v_heads=3),
                                  dict(arch="qwen35moe", dtype="q8_0", n_ff_shexp=48),
                                  dict(arch="gpt-oss", expert_dtype="mxfp4", n_ff_exp=48),
                                  dict(arch="gpt-oss", expert_dtype="q9")])
def test_impossible_dimensions_raise_a_clear_error(tmp_path, dims):
    with pytest.raises(TestModelError):
        make_model(tmp_path / "x.gguf", **dims)


def test_cli_writes_a_model(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["make-model", str(out), "--arch", "llama", "--dtype", "q8_0",
                 "--layers", "1"]) == 0
    _, kv = _fields(out)
    assert kv["llama.block_count"] == 1
    assert str(out) in capsys.readouterr().out


@pytest.mark.parametrize("arch, gguf_arch", [("qwen3", "qwen3"), ("mixtral", "llama"),
                                             ("gemma3", "gemma3"), ("qwen35", "qwen35"),
                                             ("qwen35moe", "qwen35moe"),
                                             ("gpt-oss", "gpt-oss")])
def test_cli_writes_the_new_architectures(tmp_path, arch, gguf_arch):
    out = tmp_path / f"{arch}.gguf"
    assert main(["make-model", str(out), "--arch", arch, "--layers", "1",
                 "--experts", "4", "--experts-used", "1"]) == 0
    _, kv = _fields(out)
    assert kv["general.architecture"] == gguf_arch
    assert kv.get(f"{gguf_arch}.expert_count") == (4 if arch in ("mixtral", "qwen35moe",
                                                                  "gpt-oss") else None)


def test_cli_reports_impossible_dimensions_in_one_line(tmp_path, capsys):
    out = tmp_path / "bad.gguf"
    assert main(["make-model", str(out), "--heads", "4", "--heads-kv", "3"]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("python -m kvasird_dev: n_head 4 must be a multiple of n_head_kv 3")
    assert not out.exists()


@pytest.mark.slow
def test_q4_k_m_gives_tensors_llamacpps_types_and_repeated_experts_repeat(tmp_path) -> None:
    """The benchmark models' type: Q6_K for the output and for attn_v / ffn_down of the
    layers llama.cpp's Q4_K_M gives more bits (of 8: 0, 3, 6, 7), Q4_K elsewhere; with
    ``distinct_experts`` the experts' bytes repeat, and the engine computes the file."""
    from gguf import GGMLQuantizationType as Q

    from kvasird.compute.stage import Stage

    path = make_model(tmp_path / "m.gguf", "qwen3moe", n_layer=8, n_embd=256, n_head=4,
                      n_head_kv=2, head_dim=64, n_ff_exp=256, n_expert=4, distinct_experts=2,
                      dtype="q4_k_m")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for kind in ("attn_v", "ffn_down_exps"):
        six = [i for i in range(8) if tensors[f"blk.{i}.{kind}.weight"].tensor_type == Q.Q6_K]
        assert six == [0, 3, 6, 7], kind
    assert {tensors[f"blk.{i}.{k}.weight"].tensor_type for i in range(8)
            for k in ("attn_q", "attn_k", "ffn_gate_exps", "ffn_up_exps")} == {Q.Q4_K}
    assert tensors["output.weight"].tensor_type == Q.Q6_K
    assert tensors["token_embd.weight"].tensor_type == Q.Q4_K
    assert tensors["blk.0.attn_norm.weight"].tensor_type == Q.F32
    gate = np.asarray(tensors["blk.1.ffn_gate_exps.weight"].data)
    assert (gate[0] == gate[2]).all() and (gate[1] == gate[3]).all()
    assert not (gate[0] == gate[1]).all()
    stage = Stage.load(path)
    try:
        with stage.open_session() as s:
            assert np.isfinite(stage.forward(s, np.array([1, 2, 3]))).all()
    finally:
        stage.close()
