"""Sliding-window layers keep only their window of KV (kv/window.py's window pool): the logits
stay bitwise those of a cache that keeps every position (KVSpec.swa_full), across chunked
prefills, ring wrap-arounds, rewinds and interleaved sessions, in a fraction of the memory."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvasird.compute.errors import InputError, KVCacheFull
from kvasird.compute.kv.keys import PAGE
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.kv.window import ring_pages
from kvasird.compute.stage import MAX_CHUNK, Stage, generate
from kvasird_dev.testmodels import make_model

pytestmark = pytest.mark.slow  # a minute of prefills and decodes over windowed caches

RING = KVSpec(n_slots=4096, dtype="f16", window_sessions=3)
FULL = KVSpec(n_slots=4096, dtype="f16", swa_full=True)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """gemma3 with a 4-position window, gemma3 with a 100-position one (windows spanning
    pages), gpt-oss with 4 (sinks, experts): layers 0 and 2 windowed, 1 global."""
    d = tmp_path_factory.mktemp("swa")
    return {"gemma3": make_model(d / "gemma3.gguf", arch="gemma3", n_layer=3, seed=5),
            "gemma3-100": make_model(d / "gemma3w.gguf", arch="gemma3", n_layer=3,
                                     sliding_window=100, seed=6),
            "gpt-oss": make_model(d / "gpt-oss.gguf", arch="gpt-oss", n_layer=3, seed=13)}


@pytest.fixture(scope="module")
def stages(windowed):
    """{(model, "ring" | "full"): stage}."""
    out = {(name, kind): Stage.load(path, threads=1, kv=RING if kind == "ring" else FULL)
           for name, path in windowed.items() for kind in ("ring", "full")}
    yield out
    for stage in out.values():
        stage.close()


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


def run(stage: Stage, pieces: list[np.ndarray]) -> np.ndarray:
    """Every position's logits, the prompt fed in `pieces` (a 1-token piece is a decode step)."""
    with stage.open_session() as s:
        return np.concatenate([stage.forward(s, p, logits="all") for p in pieces])


MODELS = ["gemma3", "gemma3-100", "gpt-oss"]


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_and_decode_past_many_windows_equal_the_full_cache(stages, name):
    """A 1200-token prefill (three graphs: longer than a ring, which wraps twice) then 150
    decode steps across the ring's wrap from slot 9 to 0 at position 1280."""
    ring, full = stages[name, "ring"], stages[name, "full"]
    assert ring.kv.ring * PAGE < 1200 < 1280 < 1350
    prompt = tokens(1350)
    pieces = [prompt[:1200], *(prompt[i:i + 1] for i in range(1200, 1350))]
    np.testing.assert_array_equal(run(ring, pieces), run(full, pieces))


@pytest.mark.parametrize("name", MODELS)
def test_forwards_of_uneven_lengths_equal_the_full_cache(stages, name):
    """Pieces starting and ending anywhere in a page, one of them a whole chunk."""
    prompt = tokens(1800, seed=1)
    cuts = [0, 700, 701, 764, 829, 1341, 1500, 1800]
    pieces = [prompt[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    np.testing.assert_array_equal(run(stages[name, "ring"], pieces),
                                  run(stages[name, "full"], pieces))


@pytest.mark.parametrize("name", MODELS)
def test_a_rejected_draft_rewinds_within_the_ring(stages, name):
    """Decode 40 tokens, take back 30 and continue differently, by truncate and by a
    forward from an earlier start: as the full cache computes it."""
    prompt, draft, other = tokens(900, seed=2), tokens(40, seed=3), tokens(30, seed=4)
    got = []
    for kind in ("ring", "full"):
        stage = stages[name, kind]
        with stage.open_session() as s:
            stage.forward(s, prompt)
            for t in draft:
                stage.forward(s, np.array([t]))
            s.truncate(910)
            a = stage.forward(s, other, logits="all")
            b = stage.forward(s, other[:5], start=920, logits="all")
            got.append(np.concatenate([a, b]))
    np.testing.assert_array_equal(*got)


@pytest.mark.parametrize("name", MODELS)
def test_a_rewind_past_the_ring_asks_for_a_replay(stages, name):
    ring, full = stages[name, "ring"], stages[name, "full"]
    prompt = tokens(1500, seed=5)
    with ring.open_session() as s:
        ring.forward(s, prompt)
        with pytest.raises(InputError, match="replay the history from position 0"):
            s.truncate(200)
        with pytest.raises(InputError, match="replay the history from position 0"):
            ring.forward(s, prompt[200:210], start=200)
        assert s.n_past == 1500
        replayed = ring.forward(s, prompt[:210], start=0)
    with full.open_session() as s:  # the full cache goes back anywhere
        full.forward(s, prompt)
        s.truncate(200)
        np.testing.assert_array_equal(full.forward(s, prompt[200:210]), replayed)


def test_interleaved_sessions_each_equal_their_own_run(stages):
    """Three sessions of the 3-ring pool stepping in turn, prefills and decodes mixed."""
    ring, full = stages["gemma3-100", "ring"], stages["gemma3-100", "full"]
    prompts = [tokens(710 + 37 * i, seed=10 + i) for i in range(3)]
    pieces = [[p[:600], *(p[j:j + 1] for j in range(600, 700)), p[700:]] for p in prompts]
    sessions = [ring.open_session() for _ in prompts]
    got: list[list[np.ndarray]] = [[] for _ in prompts]
    try:
        for turn in range(len(pieces[0])):
            for i, s in enumerate(sessions):
                got[i].append(ring.forward(s, pieces[i][turn], logits="all"))
    finally:
        for s in sessions:
            s.close()
    for i in range(len(prompts)):
        np.testing.assert_array_equal(np.concatenate(got[i]), run(full, pieces[i]))

@pytest.mark.parametrize("name", MODELS)
def test_a_batch_of_decode_steps_equals_each_session_alone(stages, name):
    """Stage.forward_batch over windowed rings: three sessions at different positions (one
    inside its first window, one across a page of a 100-position window, one whose ring
    has wrapped) decode 70 steps as one graph each, bitwise as the full cache batches them
    (each session attends over its own ring), and as each decodes alone to float rounding
    (these F32 matrix products block a batch's rows differently from one row)."""
    ring, full = stages[name, "ring"], stages[name, "full"]
    prompts = [tokens(n, seed=20 + n) for n in (3, 130, 1100)]
    steps = [tokens(70, seed=30 + i) for i in range(len(prompts))]

    def decode(stage: Stage, batched: bool) -> np.ndarray:
        sessions = [stage.open_session() for _ in prompts]
        try:
            for s, p in zip(sessions, prompts, strict=True):
                stage.forward(s, p)
            rows = []
            for j in range(70):
                runs = [(s, steps[i][j:j + 1], s.n_past) for i, s in enumerate(sessions)]
                rows.append(np.concatenate(stage.forward_batch(runs) if batched else
                                           [stage.forward(s, x, at) for s, x, at in runs]))
            return np.stack(rows)
        finally:
            for s in sessions:
                s.close()

    batched = decode(ring, True)
    np.testing.assert_array_equal(batched, decode(full, True))
    np.testing.assert_allclose(batched, decode(ring, False), rtol=0,
                               atol=1e-3 * np.abs(batched).max())



def test_a_session_without_a_ring_page_gets_kv_cache_full(windowed):
    """The window pool holds 2 rings (20 pages): a third session fits while short and is
    refused once it needs a ring page none is left for; free_tokens says so before."""
    stage = Stage.load(windowed["gemma3"], threads=1,
                       kv=KVSpec(n_slots=4096, dtype="f16", window_sessions=2))
    try:
        kv = stage.kv
        a, b, c = (stage.open_session() for _ in range(3))
        stage.forward(a, tokens(2000))  # 32 pages, a whole ring of 10
        assert len(a.ring) == kv.ring == 10 and kv.free_tokens == 32 * PAGE
        stage.forward(b, tokens(100))  # 2 pages, 2 ring pages
        assert kv.free_tokens == 8 * PAGE  # bound by the window pool, not the main pool's 30
        stage.forward(c, tokens(kv.free_tokens))
        assert kv.free_tokens == 0 and len(kv._free) == 22
        with pytest.raises(KVCacheFull, match="sliding-window pool"):
            stage.forward(c, tokens(1))
        for s in (a, b, c):
            s.close()
        assert kv.free_tokens == kv.n_slots
    finally:
        stage.close()


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss"])
def test_window_layers_hold_one_ring_per_window_session(windowed, arch):
    """4096 slots, one window session: the global layer keeps 4096 positions, the two
    windowed ones a ring of ceil((4 + 510) / 64) + 1 pages each (640 positions)."""
    ring_kv = KVSpec(n_slots=4096, dtype="f16", window_sessions=1)
    full_kv = KVSpec(n_slots=4096, dtype="f16", swa_full=True)
    sizes = []
    for kv in (ring_kv, full_kv):
        stage = Stage.load(windowed[arch], threads=1, kv=kv)
        sizes.append(stage.kv.arena.nbytes)
        row = stage.hp.kv_dim * 2 * 2  # K and V, f16
        stage.close()
    assert ring_pages(4, MAX_CHUNK) == 10
    assert sizes == [row * (4096 + 2 * 10 * PAGE), row * 3 * 4096]


def test_a_model_without_windows_is_unaffected(tmp_path):
    path = make_model(tmp_path / "qwen3.gguf", arch="qwen3", n_layer=3)
    sizes = set()
    for kv in (KVSpec(n_slots=1024, window_sessions=1), KVSpec(n_slots=1024, swa_full=True)):
        stage = Stage.load(path, threads=1, kv=kv)
        assert not stage.kv.window_layers and stage.kv.n_window_pages == 0
        with stage.open_session() as s:
            stage.forward(s, tokens(300))
            assert s.ring == []
        assert all(not name.startswith("swa_") and name != "mask_swa"
                   for _, graph in stage.graphs.items() for name in graph.inputs)
        sizes.add(stage.kv.arena.nbytes)
        stage.close()
    assert sizes == {3 * 1024 * 32 * 2 * 2}


LLAMACPP_PYTHON = Path(__file__).resolve().parents[2] / ".cache/llamacpp-venv/bin/python"

_LLAMACPP = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=1, n_batch=512, swa_full=False,
            logits_all=True, verbose=False)
tokens = json.loads(sys.stdin.read())
llm.eval(tokens)
logits = llm.scores[llm.n_tokens - 1].tolist()
greedy = []
for _ in range(16):
    greedy.append(int(llm.scores[llm.n_tokens - 1].argmax()))
    llm.eval([greedy[-1]])
print(json.dumps({"logits": logits, "greedy": greedy}))
"""


@pytest.mark.llamacpp
@pytest.mark.skipif(not LLAMACPP_PYTHON.exists(), reason="run native/llamacpp to build llama.cpp")
@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_long_prompts_give_llamacpps_bounded_cache_logits(windowed, stages, name):
    """A 1300-token prompt (past many windows and two ring turns) and 16 greedy steps, against
    llama.cpp with its sliding-window cache bounded by the window."""
    prompt = tokens(1300, seed=20)
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", _LLAMACPP, str(windowed[name])],
                          input=json.dumps([int(t) for t in prompt]), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ref = json.loads(done.stdout)
    stage = stages[name, "ring"]
    got = generate(stage, prompt, 16)
    with stage.open_session() as s:
        logits = stage.forward(s, prompt)[0]
    want = np.array(ref["logits"])
    assert int(logits.argmax()) == int(want.argmax())
    assert np.abs(logits - want).max() < 1e-4 * np.abs(want).max()
    assert got == ref["greedy"]
