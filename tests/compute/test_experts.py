"""Expert workers, router authority and split dispatch against the monolithic MoE layer."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf import GGUFWriter

from kvasird.compute.errors import ComputeError, InputError, WeightsError
from kvasird.compute.experts import ExpertShard, ExpertWorker, dispatch
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import Backend
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage
from kvasird.compute.weights import load_weights
from kvasird.numerics.metrics import compare
from kvasird.numerics.oracle import Oracle

EXACT_KV = KVSpec(n_slots=512, dtype="f32")
"""F32 KV: the engine then differs from the float64 oracle only by float32 rounding."""

PROMPT = np.array([1, 504, 3458, 314, 4649, 282, 4649, 30, 7000, 12])
EXPS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def worker_for(path, layers, first, end) -> ExpertWorker:
    names = [f"blk.{layer}.{s}" for layer in layers for s in EXPS]
    weights = load_weights(path, Backend(1), names, {layer: (first, end) for layer in layers})
    return ExpertWorker(weights, Backend(1))


def split_stage(path, n_workers: int) -> Stage:
    n_layer, n_expert = Oracle(path).hp.n_layer, Oracle(path).hp.n_expert
    step = n_expert // n_workers
    workers = [worker_for(path, range(n_layer), e, e + step) for e in range(0, n_expert, step)]
    shards = {layer: [w.shard(layer) for w in workers] for layer in range(n_layer)}
    return Stage.load(path, threads=1, kv=EXACT_KV, experts=shards)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 64)).astype(np.float32)


def test_worker_matches_oracle_experts_for_its_range(models):
    oracle, worker = Oracle(models["moe"]), worker_for(models["moe"], [1], 4, 8)
    x = rows(16)
    sel = np.random.default_rng(1).integers(0, 4, (16, 2))
    got = worker(1, x, sel)
    assert got.shape == (16, 2, 64)
    assert compare(got, oracle.experts(1, x.astype(np.float64), sel + 4)).rel_linf < 1e-5


@pytest.mark.parametrize("n_workers", [2, 4])
def test_expert_split_matches_monolithic(models, n_workers):
    whole = Stage.load(models["moe"], threads=1, kv=EXACT_KV)
    split = split_stage(models["moe"], n_workers)
    assert len(split.segments) == whole.hp.n_layer + 1 and len(whole.segments) == 1
    with whole.open_session() as a, split.open_session() as b:
        want = whole.forward(a, PROMPT, logits="all")
        got = split.forward(b, PROMPT, logits="all")
        step = (whole.forward(a, np.array([77])), split.forward(b, np.array([77])))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(step[1] - step[0]).max() <= 1e-5 * np.abs(step[0]).max()


def test_dispatch_hook_receives_local_ids_and_its_rows_only(models):
    oracle = Oracle(models["moe"])
    calls = []

    def remote(first):
        def call(layer, x, local_ids):
            calls.append((layer, first, len(x), local_ids.copy()))
            return oracle.experts(layer, x.astype(np.float64), local_ids + first)
        return call

    shards = {layer: [ExpertShard(0, 3, remote(0)), ExpertShard(3, 8, remote(3))]
              for layer in range(3)}
    stage = Stage.load(models["moe"], threads=1, kv=EXACT_KV, experts=shards)
    with stage.open_session() as s:
        got = stage.forward(s, PROMPT, logits="all")
    assert compare(got, oracle.logits(PROMPT)).rel_linf < 1e-5
    for _, first, n, ids in calls:
        assert 0 <= ids.min() and ids.max() < (3 if first == 0 else 5)
        assert 1 <= n <= len(PROMPT)
    assert sum(n for *_, n, _ in calls) >= len(PROMPT) * 3


def test_uncovered_expert_is_a_clear_error(models):
    worker = worker_for(models["moe"], range(3), 0, 4)
    shards = {layer: [worker.shard(layer)] for layer in range(3)}
    stage = Stage.load(models["moe"], threads=1, kv=EXACT_KV, experts=shards)
    with stage.open_session() as s, pytest.raises(ComputeError, match="no shard holds expert"):
        for t in range(40):
            stage.forward(s, np.array([t * 997]))


def test_overlapping_shards_are_refused(models):
    w = worker_for(models["moe"], [0], 0, 4)
    with pytest.raises(ComputeError):
        Stage.load(models["moe"], threads=1, experts={0: [w.shard(0), ExpertShard(2, 6, w)]})


def test_partial_experts_without_shards_are_refused(models):
    with pytest.raises(WeightsError):
        Stage.load(models["moe"], threads=1, expert_ranges={1: (0, 4)})


def test_batch_rows_are_independent_of_batch_size(models):
    worker = worker_for(models["moe"], [0], 0, 8)
    x = rows(37, seed=5)
    sel = np.random.default_rng(2).integers(0, 8, (37, 2))
    batched = worker(0, x, sel)
    single = np.stack([worker(0, x[i:i + 1], sel[i:i + 1])[0] for i in range(37)])
    assert np.abs(batched - single).max() <= 1e-6 * np.abs(single).max()


def test_worker_is_safe_from_two_threads(models):
    worker = worker_for(models["moe"], [0], 0, 8)
    x = rows(8)
    sel_a = np.zeros((8, 2), np.int64)
    sel_b = np.full((8, 2), 7)
    want_a, want_b = worker(0, x, sel_a), worker(0, x, sel_b)
    bad = []

    def hammer(sel, want):
        for _ in range(30):
            if not np.array_equal(worker(0, x, sel), want):
                bad.append(1)

    threads = [threading.Thread(target=hammer, args=a) for a in ((sel_a, want_a), (sel_b, want_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@pytest.mark.parametrize("layer, x, sel", [
    (0, rows(2), np.array([[0, 4], [1, 2]])),        # local id past the held range
    (0, rows(2), np.array([[0, -1], [1, 2]])),       # negative id
    (0, rows(2), np.array([[0, 1, 2], [1, 2, 3]])),  # more than n_expert_used
    (0, rows(2), np.array([[0.0, 1.0], [1, 2]])),    # float ids
    (0, rows(2)[:, :32], np.array([[0, 1], [1, 2]])),  # wrong width
    (0, rows(3), np.array([[0, 1], [1, 2]])),        # row count mismatch
    (2, rows(2), np.array([[0, 1], [1, 2]])),        # layer not held
])
def test_bad_worker_requests_raise_before_ggml(models, layer, x, sel):
    worker = worker_for(models["moe"], [0, 1], 4, 8)
    with pytest.raises(InputError):
        worker(layer, x, sel)
    assert worker(0, rows(2), np.array([[0, 3], [1, 2]])).shape == (2, 2, 64)


def test_slice_with_expert_slab_loads_like_the_full_file(models, tmp_path):
    """A mini-GGUF holding experts [2, 6) of layer 1 as a byte slab serves the same rows."""
    full = GGUFFile(models["moe"])
    path = tmp_path / "slice.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    for key in ("block_count", "embedding_length", "attention.head_count",
                "attention.head_count_kv", "attention.key_length",
                "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count",
                "expert_feed_forward_length"):
        value = full.metadata[f"qwen3moe.{key}"]
        if isinstance(value, float):
            w.add_float32(f"qwen3moe.{key}", value)
        else:
            w.add_uint32(f"qwen3moe.{key}", value)
    w.add_uint32("qwen3moe.vocab_size", 49152)
    for s in EXPS:
        info = full.info(f"blk.1.{s}")
        slab = info.nbytes // 8
        data = np.array(full.data(info.name)[2 * slab:6 * slab]).view(np.float32)
        w.add_tensor(info.name, data.reshape(4, info.ne[1], info.ne[0]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sliced = worker_for(path, [1], 2, 6)
    ranged = worker_for(models["moe"], [1], 2, 6)
    x, sel = rows(5), np.random.default_rng(3).integers(0, 4, (5, 2))
    np.testing.assert_array_equal(sliced(1, x, sel), ranged(1, x, sel))


@pytest.mark.parametrize("seed", range(20))
def test_a_single_row_is_dispatched_like_a_row_of_a_batch(seed):
    """The decode step's one-row path asks every shard for the same ids, in the same slot
    order, and assembles the same outputs as the general path does for that row."""
    rng = np.random.default_rng(seed)
    n_expert, k = 8, int(rng.integers(1, 5))
    cuts = sorted({0, n_expert, *rng.integers(1, n_expert, size=int(rng.integers(0, 4)))})
    asked: dict[str, list] = {"one": [], "batch": []}

    def shard(first, end, who):
        def call(layer, x, sel):
            asked[who].append((first, sel[:1].tolist()))
            return x[:, None, :] * (sel[:, :, None] + first + 1).astype(np.float32)
        return ExpertShard(first, end, call)

    ids = rng.choice(n_expert, size=(1, k), replace=False)
    cur = rng.standard_normal((1, 16)).astype(np.float32)
    ranges = list(zip(cuts, cuts[1:], strict=False))
    one = dispatch(0, cur, ids, [shard(a, b, "one") for a, b in ranges])
    both = dispatch(0, np.repeat(cur, 2, axis=0), np.repeat(ids, 2, axis=0),
                    [shard(a, b, "batch") for a, b in ranges])
    assert np.array_equal(one[0], both[0])
    assert asked["one"] == asked["batch"]


@pytest.mark.parametrize("seed", range(10))
def test_where_shards_overlap_an_id_goes_to_the_first_that_holds_it(seed):
    """A stage's cached experts come before the remote ranges that also hold them: each
    id is computed once, by the first shard holding it, on the one-row and batch paths."""
    rng = np.random.default_rng(seed)
    n_expert, k = 8, int(rng.integers(1, 5))
    cached = sorted(int(e) for e in rng.choice(n_expert, int(rng.integers(1, 5)), replace=False))
    asked: dict[str, list] = {"one": [], "batch": []}

    def shard(first, end, who):
        def call(layer, x, sel):
            asked[who].append((first, end, (sel[:1] + first).tolist()))
            return x[:, None, :] * (sel[:, :, None] + first + 1).astype(np.float32)
        return ExpertShard(first, end, call)

    def shards(who):
        return [*(shard(e, e + 1, who) for e in cached), shard(0, 5, who), shard(5, 8, who)]

    ids = rng.choice(n_expert, size=(1, k), replace=False)
    cur = rng.standard_normal((1, 16)).astype(np.float32)
    one = dispatch(0, cur, ids, shards("one"))
    both = dispatch(0, np.repeat(cur, 2, axis=0), np.repeat(ids, 2, axis=0), shards("batch"))
    assert np.array_equal(one[0], both[0]) and asked["one"] == asked["batch"]
    assert np.allclose(one[0], cur[0][None, :] * (ids[0][:, None] + 1))
    done = [g for _, _, sel in asked["one"] for g in sel[0]]
    assert sorted(done) == sorted(ids[0].tolist())  # each once
    for first, end, sel in asked["one"]:
        assert end - first == 1 or not set(sel[0]) & set(cached)


def test_a_single_row_with_an_uncovered_expert_or_a_wrong_shape_is_an_error():
    cur, ids = np.ones((1, 4), np.float32), np.array([[1, 6]])
    ok = ExpertShard(0, 4, lambda layer, x, sel: np.zeros((1, sel.shape[1], 4), np.float32))
    with pytest.raises(ComputeError, match="no shard holds expert 6"):
        dispatch(0, cur, ids, [ok])
    bad = ExpertShard(4, 8, lambda layer, x, sel: np.zeros((1, 3, 4), np.float32))
    with pytest.raises(ComputeError, match=r"returned shape \[1, 3, 4\], expected \[1, 1, 4\]"):
        dispatch(0, cur, ids, [ok, bad])


@pytest.mark.parametrize("dtype", ["q4_k", "q6_k"])
def test_an_experts_output_for_a_row_is_the_same_in_any_batch(tmp_path, dtype):
    """A row's expert outputs do not depend on the rows batched with it (other sessions'
    at a worker): 16 rows routed to the same experts give, bit for bit, what each gives
    alone. (ggml's tiled MUL_MAT_ID kernel, which native/ggml-source keeps out, moved Q6_K
    experts' outputs by 1.7e-3 from 8 rows an expert on.)"""
    from kvasird_dev.testmodels import make_model

    path = make_model(tmp_path / "m.gguf", arch="qwen3moe", n_layer=1, dtype=dtype, n_embd=256,
                      head_dim=64, n_ff_exp=256, n_expert=8, n_expert_used=4)
    backend = Backend(1)
    names = [f"blk.0.ffn_{k}_exps.weight" for k in ("gate", "up", "down")]
    worker = ExpertWorker(load_weights(path, backend, names), backend)
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((16, 256)).astype(np.float32)
        sel = np.tile(rng.choice(8, 4, replace=False), (16, 1))
        batched = worker(0, x, sel)
        alone = np.concatenate([worker(0, x[i:i + 1], sel[i:i + 1]) for i in range(16)])
        np.testing.assert_array_equal(batched, alone)
    finally:
        worker.close()
        worker.weights.close()
        backend.close()
