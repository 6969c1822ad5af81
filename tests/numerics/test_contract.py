"""The numerics contract: metrics, op probes, the oracle's ggml rounding, and `kvasird verify`."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kvasird.cli import main
from kvasird.compute.graph import Backend
from kvasird.numerics.contract import Check, VerifyPlan, verify
from kvasird.numerics.metrics import compare, first_divergence
from kvasird.numerics.ops import probe_ops
from kvasird_dev.testmodels import make_model

SMALL = VerifyPlan(prompts=2, prompt_len=6, greedy_prompts=1, greedy_tokens=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("numerics")
    return {"f32": make_model(d / "f32.gguf", n_layer=2, seed=7),
            "q8": make_model(d / "q8.gguf", arch="llama", n_layer=2, dtype="q8_0", seed=8),
            "q4k": make_model(d / "q4k.gguf", n_layer=1, n_embd=256, head_dim=64, n_ff_exp=256,
                              dtype="q4_k", tied_output=True, seed=9)}


def test_compare_measures_distance_and_agreement():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 50))
    same = compare(a, a)
    assert same.linf == 0 and same.kl == pytest.approx(0, abs=1e-12) and same.top1 == 1
    noisy = compare(a + 0.1 * rng.standard_normal(a.shape), a)
    assert 0 < noisy.rel_l2 < 0.2 and noisy.cosine < 1 and noisy.kl > 0
    flipped = a.copy()
    flipped[0, a[0].argmin()] = a.max() + 1
    assert compare(flipped, a).top1 == 0.75


def test_first_divergence_index():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_check_bounds_have_a_direction():
    assert Check("x", 0.5, 1.0, "max").ok and not Check("x", 1.5, 1.0, "max").ok
    assert Check("x", 0.9995, 0.999, "min").ok and not Check("x", 0.99, 0.999, "min").ok


@pytest.mark.parametrize("model", ["q8", "q4k"])
def test_oracle_rounding_activations_like_ggml_matches_quantized_matmul(tiny, model):
    deltas = {d.op: d.delta for d in probe_ops(str(tiny[model]), Backend(1))}
    rounded = {op: d for op, d in deltas.items() if op.endswith("ggml-rounded")}
    exact = {op: d for op, d in deltas.items() if op.startswith("matmul") and op not in rounded}
    assert rounded and all(d.rel_l2 < 1e-5 for d in rounded.values())
    assert any(d.rel_l2 > 1e-4 for op, d in exact.items() if "F32" not in op)


def test_verify_passes_an_f32_model_at_float_rounding(tiny):
    v = verify(tiny["f32"], threads=1, plan=replace(SMALL, kv_dtype="f32"))
    assert v.passed, [c for c in v.checks if not c.ok]
    assert v.logits.rel_l2 < 1e-5 and len(v.drift) == 2
    assert v.capability() == {"backend": "CPU", "precision": v.precision, "numerics_pass": True}
    assert "weights F32; kv f32" in v.precision


def test_verify_holds_f32_models_to_tighter_bounds_than_quantized(tiny):
    v = verify(tiny["q8"], threads=1, plan=SMALL)
    f = verify(tiny["f32"], threads=1, plan=SMALL)
    bound = {c.name: c.bound for c in v.checks}
    assert {c.name: c.bound for c in f.checks}["logits cosine"] > bound["logits cosine"]
    assert "Q8_0" in v.precision


def test_verify_cli_prints_a_json_verdict(tiny, capsys, tmp_path):
    rc = main(["--home", str(tmp_path / "home"), "verify", "--model", str(tiny["f32"]),
               "--prompts", "1", "--greedy-tokens", "2", "--threads", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["passed"] is True
    assert all(c["ok"] for c in doc["checks"])
