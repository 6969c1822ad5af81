"""A GGUF whose tensors do not fit its own metadata is refused as a WeightsError naming the
tensor, never handed to ggml (whose failed asserts abort the whole daemon): at
`check_file` (model add, run, localnet up) and when weights, a peer's slices too, load."""

from __future__ import annotations

import contextlib
import mmap
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from kvasird.compute import arch as archs
from kvasird.compute.errors import WeightsError
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import Backend
from kvasird.compute.hparams import HParams
from kvasird.compute.shapes import check_tensors
from kvasird.compute.stage import Stage, generate
from kvasird.compute.weights import load_weights
from kvasird.model.gguffile import read_header
from kvasird.model.manifest import Manifest
from kvasird.model.slice import _add_metadata
from kvasird_dev.testmodels import ARCHS, make_model, save

Tensor = tuple[str, int, tuple[int, ...], bytes]
"""(name, ggml type, ne, bytes) of one tensor being rewritten."""


def rewrite(src: Path, dst: Path, edit: Callable[[Tensor], Iterable[Tensor]] = lambda t: [t],
            meta: dict[str, int] | None = None) -> Path:
    """`src` again, each tensor through `edit` and the uint32 keys of `meta` set (without
    the tokenizer, which nothing here reads)."""
    header, meta = read_header(src), dict(meta or {})
    arch = next(v for k, _, v in header.metadata if k == "general.architecture").decode()
    w = GGUFWriter(str(dst), arch)
    for key, vtype, value in header.metadata:
        if key in meta:
            w.add_uint32(key, meta.pop(key))
        elif not key.startswith(("tokenizer.", "general.architecture", "general.alignment")):
            _add_metadata(w, key, vtype, value)
    for key, value in meta.items():
        w.add_uint32(key, value)
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        base = header.data_offset
        for t in header.tensors:
            data = bytes(mm[base + t.offset:base + t.offset + t.length])
            for name, type_, ne, raw in edit((t.name, t.ggml_type, t.ne, data)):
                shape = (*reversed(ne[1:]), len(raw) // max(1, int(np.prod(ne[1:]))))
                w.add_tensor(name, np.frombuffer(raw, np.uint8).reshape(shape), raw_dtype=type_)
    return save(w, dst)


def shrink(name: str, by: int) -> Callable[[Tensor], Iterable[Tensor]]:
    """Cut `by` off the outermost dimension of tensor `name` (rows, or experts)."""
    def edit(t: Tensor) -> Iterable[Tensor]:
        n, type_, ne, raw = t
        if n != name:
            return [t]
        keep = ne[-1] - by
        return [(n, type_, (*ne[:-1], keep), raw[:len(raw) // ne[-1] * keep])]
    return edit


def refusal(path: Path) -> str:
    with pytest.raises(WeightsError) as exc:
        archs.check_file(path)
    return str(exc.value)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("shapes")
    return {"qwen3": make_model(d / "qwen3.gguf", arch="qwen3", n_layer=2, seed=1),
            "llama": make_model(d / "llama.gguf", arch="llama", n_layer=2, seed=2),
            "qwen3moe": make_model(d / "moe.gguf", arch="qwen3moe", n_layer=2, seed=3)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
@pytest.mark.parametrize("dims", [{"dtype": "f32"}, {"dtype": "q8_0"},
                                  {"dtype": "q4_k", "n_embd": 256, "n_ff": 512, "n_ff_exp": 256,
                                   "n_ff_shexp": 256, "head_dim": 64, "ssm_head_dim": 64}],
                         ids=["f32", "q8_0", "q4_k"])
def test_every_generated_model_matches_its_metadata(tmp_path, arch, dims):
    path = make_model(tmp_path / "m.gguf", arch=arch, n_layer=2, **dims)
    hp = archs.check_file(path)
    f = GGUFFile(path)
    check_tensors(hp, f.tensors, path)


def test_a_wrong_width_query_is_refused_naming_the_tensor(base, tmp_path):
    text = refusal(rewrite(base["qwen3"], tmp_path / "bad.gguf", shrink("blk.1.attn_q.weight", 16)))
    assert "does not match its own metadata" in text and "convert it again" in text
    assert "blk.1.attn_q.weight is [64, 48], expected [64, 64] = [n_embd, n_head*head_dim]" in text


def test_a_missing_tensor_is_refused(base, tmp_path):
    bad = rewrite(base["qwen3"], tmp_path / "bad.gguf",
                  lambda t: [] if t[0] == "blk.0.attn_k.weight" else [t])
    assert "blk.0.attn_k.weight: missing" in refusal(bad)


def test_experts_fewer_than_expert_count_are_refused(base, tmp_path):
    bad = rewrite(base["qwen3moe"], tmp_path / "bad.gguf", shrink("blk.1.ffn_up_exps.weight", 2))
    assert ("blk.1.ffn_up_exps.weight is [64, 32, 6], expected [64, 32, 8] = "
            "[n_embd, n_ff_exp, experts]") in refusal(bad)


def test_an_expert_count_the_tensors_do_not_have_is_refused(base, tmp_path):
    text = refusal(rewrite(base["qwen3moe"], tmp_path / "bad.gguf",
                           meta={"qwen3moe.expert_count": 6}))
    assert "blk.0.ffn_gate_inp.weight is [64, 8], expected [64, 6]" in text
    assert "(and " in text  # every layer's router and experts: the first few are shown


def test_a_head_count_that_does_not_fit_the_projections_is_refused(base, tmp_path):
    """llama derives head_dim as n_embd / n_head: 64 / 6 leaves heads of 10."""
    text = refusal(rewrite(base["llama"], tmp_path / "bad.gguf",
                           meta={"llama.attention.head_count": 6,
                                 "llama.rope.dimension_count": 10}))
    assert "blk.0.attn_q.weight is [64, 64], expected [64, 60]" in text


def test_no_heads_at_all_is_refused_not_a_division_by_zero(base, tmp_path):
    text = refusal(rewrite(base["llama"], tmp_path / "bad.gguf",
                           meta={"llama.attention.head_count_kv": 0}))
    assert "head_count_kv 0 must be positive" in text


def test_a_head_dim_other_than_the_kv_tensors_hold_is_refused(base, tmp_path):
    text = refusal(rewrite(base["qwen3"], tmp_path / "bad.gguf",
                           meta={"qwen3.attention.key_length": 32,
                                 "qwen3.attention.value_length": 32}))
    assert "blk.0.attn_k.weight is [64, 32], expected [64, 64]" in text
    assert "blk.0.attn_q_norm.weight is [16], expected [32] = [head_dim]" in text


def test_a_slice_holding_other_experts_than_it_records_is_refused(base):
    """A peer's expert slice says experts 2..6 of layer 0; its tensors must hold 4."""
    f = GGUFFile(base["qwen3moe"])
    hp = HParams.from_gguf(f)
    layer0 = {n: t for n, t in f.tensors.items() if n.startswith("blk.0.ffn_") and "exps" in n}
    check_tensors(hp, layer0, "slice", held=(0, 0, 8))
    with pytest.raises(WeightsError, match=r"ffn_down_exps.weight is \[32, 64, 8\], expected "
                                           r"\[32, 64, 4\]"):
        check_tensors(hp, layer0, "slice", held=(0, 2, 6))


def test_fused_gate_and_up_experts_are_refused_saying_what_to_do(base, tmp_path):
    def fuse(t: Tensor) -> Iterable[Tensor]:
        name, type_, ne, raw = t
        if name.endswith("ffn_up_exps.weight"):
            return []
        if name.endswith("ffn_gate_exps.weight"):
            return [(name.replace("gate_exps", "gate_up_exps"), type_,
                     (ne[0], 2 * ne[1], ne[2]), raw + raw)]
        return [t]
    text = refusal(rewrite(base["qwen3moe"], tmp_path / "bad.gguf", fuse))
    assert "blk.0.ffn_gate_up_exps.weight" in text and "does not load yet" in text
    assert "ffn_gate_exps and ffn_up_exps apart" in text and "convert_hf_to_gguf.py" in text


def _with_draft_block(t: Tensor) -> Iterable[Tensor]:
    """Layer 1 again as block 2, with a multi-token-prediction tensor of its own."""
    name, type_, ne, raw = t
    if not name.startswith("blk.1."):
        return [t]
    out = [t, ("blk.2." + name.removeprefix("blk.1."), type_, ne, raw)]
    if name == "blk.1.attn_norm.weight":
        out.append(("blk.2.nextn.enorm.weight", type_, ne, raw))
    return out


def test_a_draft_block_counted_as_such_is_ignored(base, tmp_path):
    """llama.cpp counts the draft (nextn, MTP) blocks in block_count and in
    nextn_predict_layers: the model served is the trunk before them."""
    path = rewrite(base["qwen3"], tmp_path / "mtp.gguf", _with_draft_block,
                   meta={"qwen3.block_count": 3, "qwen3.nextn_predict_layers": 1})
    assert archs.check_file(path).n_layer == 2
    manifest = Manifest.from_gguf(path)
    assert manifest.n_layer == 2
    assert all(p.unit.layer < 2 for p in manifest.all_pieces)
    assert sum(manifest.unit_sizes.values()) == manifest.total_bytes
    with contextlib.closing(Stage.load(path, threads=1)) as stage, \
            contextlib.closing(Stage.load(base["qwen3"], threads=1)) as trunk:
        assert stage.window == (0, 2)
        assert generate(stage, [1, 504, 3458], 3) == generate(trunk, [1, 504, 3458], 3)


def test_blocks_past_block_count_are_refused(base, tmp_path):
    path = rewrite(base["qwen3"], tmp_path / "extra.gguf", _with_draft_block)
    assert "blk.2: a block past block_count 2" in refusal(path)


def test_weights_of_a_wrong_shape_are_refused_before_loading(base, tmp_path):
    bad = rewrite(base["qwen3"], tmp_path / "bad.gguf", shrink("blk.0.attn_output.weight", 8))
    backend = Backend(1)
    try:
        with pytest.raises(WeightsError, match=r"blk.0.attn_output.weight is \[64, 56\]"):
            load_weights(bad, backend)
    finally:
        backend.close()


@pytest.mark.slow
def test_loading_a_wrong_file_exits_with_the_error_not_an_abort(base, tmp_path):
    """Without the check this file reaches ggml_mul_mat, whose assert aborts (SIGABRT)."""
    bad = rewrite(base["qwen3"], tmp_path / "bad.gguf", shrink("blk.1.attn_q.weight", 16))
    code = ("import sys; from kvasird.compute.stage import Stage, generate; "
            "generate(Stage.load(sys.argv[1], threads=1), [1, 2, 3], 2)")
    run = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "WeightsError" in run.stderr and "blk.1.attn_q.weight is [64, 48]" in run.stderr


def test_expert_tensors_of_one_layer_holding_different_counts_are_refused(base, tmp_path):
    """A file without a recorded range may hold any count of a layer's experts (a caller's
    range), but the same in each of its expert tensors."""
    bad = rewrite(base["qwen3moe"], tmp_path / "bad.gguf", shrink("blk.1.ffn_up_exps.weight", 2))
    backend = Backend(1)
    try:
        with pytest.raises(WeightsError, match=r"blk.1.ffn_up_exps.weight is \[64, 32, 6\]"):
            load_weights(bad, backend)
    finally:
        backend.close()
