"""Stages and workers loaded from the slicer's mini-GGUFs compute what the full file computes."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.compute.experts import ExpertWorker
from kvasird.compute.graph import Backend
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage
from kvasird.compute.weights import load_weights
from kvasird.model.manifest import Manifest
from kvasird.model.slice import ExpertRange, HeadSlice, LayerWindow, gguf_pieces, write_slice

EXACT_KV = KVSpec(n_slots=512, dtype="f32")
"""F32 KV: the engine then differs from the float64 oracle only by float32 rounding."""

PROMPT = np.array([1, 504, 3458, 314, 4649, 282])


@pytest.mark.parametrize("model", ["qwen3moe", "mixtral", "qwen35moe"])
def test_ring_of_slices_with_expert_slices_matches_full_model(models, arch_models, tmp_path,
                                                              model):
    path = models["moe"] if model == "qwen3moe" else arch_models[model, "q8_0"]
    manifest = Manifest.from_gguf(path)
    specs = {"a": LayerWindow(0, 2, experts=False), "b": LayerWindow(2, 3), "head": HeadSlice()}
    specs |= {f"x{layer}{e}": ExpertRange(layer, e, e + 4) for layer in (0, 1) for e in (0, 4)}
    with gguf_pieces(path, manifest) as read:
        files = {k: write_slice(manifest, s, tmp_path / f"{k}.gguf", read)
                 for k, s in specs.items()}
    workers = [ExpertWorker(load_weights(files[f"x{layer}{e}"], Backend(1)), Backend(1))
               for layer in (0, 1) for e in (0, 4)]
    shards = {layer: [w.shard(layer) for w in workers if layer in w.weights.experts]
              for layer in (0, 1)}
    first = Stage.load([files["a"], files["head"]], (0, 2), head=False, experts=shards,
                       threads=1, kv=EXACT_KV)
    last = Stage.load([files["b"], files["head"]], (2, 3), threads=1, kv=EXACT_KV)
    whole = Stage.load(path, threads=1, kv=EXACT_KV)
    assert {w.weights.experts[next(iter(w.weights.experts))].first for w in workers} == {0, 4}
    with whole.open_session() as a, first.open_session() as b, last.open_session() as c:
        want = whole.forward(a, PROMPT, logits="all")
        got = last.forward(c, first.forward(b, PROMPT), logits="all")
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_gpt_oss_expert_slice_carries_its_biases_and_computes_like_the_full_file(
        arch_models, tmp_path):
    """gpt-oss's experts have biases, stacked like their weights: the slicer cuts both (it
    once cut the weights only, and a worker on such a slice could only refuse)."""
    path = arch_models["gpt-oss", "q8_0"]
    manifest = Manifest.from_gguf(path)
    with gguf_pieces(path, manifest) as read:
        part = write_slice(manifest, ExpertRange(0, 0, 4), tmp_path / "x.gguf", read)
    rows, ids = np.random.default_rng(0).standard_normal((3, 64), np.float32), \
        np.array([[0, 3], [1, 2], [3, 0]], np.int32)
    outs = []
    for source, ranges in ((part, None), (path, {0: (0, 4)})):
        backend = Backend(1)
        worker = ExpertWorker(load_weights(source, backend, experts=ranges), backend)
        try:
            outs.append(worker(0, rows, ids))
        finally:
            worker.close()
            worker.weights.close()
            backend.close()
    assert np.array_equal(outs[0], outs[1])
