"""Side by side with llama.cpp (optional environment built by native/llamacpp; skipped without it).

llama.cpp runs in its own virtual environment, so each check runs a short script there
and compares the JSON it prints with our engine on the same GGUF and token ids.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage, generate
from kvasird.numerics.metrics import compare, first_divergence

SAME_KV = KVSpec(n_slots=1024, dtype="f16")
"""llama.cpp's default KV precision: with it, and ggml built with LLAMAFILE as llama.cpp
builds it, our graphs round where llama.cpp's do (measured: identical logits)."""

LLAMACPP_PYTHON = Path(__file__).resolve().parents[2] / ".cache/llamacpp-venv/bin/python"

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not LLAMACPP_PYTHON.exists(),
                       reason="run native/llamacpp to build llama.cpp"),
]

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "2 + 2 =",
    "List three primary colors.", "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?", "def fibonacci(n):", "The quick brown fox",
    "Explain photosynthesis in one sentence.", "Once upon a time, in a small village,",
    "What is the boiling point of water in Celsius?", "Name a famous physicist.",
    "import numpy as np\n", "The meaning of life is", "Give me a synonym for happy.",
    "How many legs does a spider have?", "SELECT * FROM users WHERE", "Dear Sir or Madam,",
    "The three laws of motion are", "Why is the sky blue?", "In 1492, Columbus",
    "A recipe for pancakes: first,",
]

_SCRIPT = """
import json, sys
from llama_cpp import Llama
path, mode, n_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
items = json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_ctx=512, n_threads=2, n_batch=512, logits_all=True, verbose=False)
out = []
for item in items:
    if mode == "chat":
        text = "<|im_start|>user\\n" + item + "<|im_end|>\\n<|im_start|>assistant\\n"
        tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    else:
        tokens = item
    llm.reset()
    llm.eval(tokens)
    logits = llm.scores[llm.n_tokens - 1].tolist()
    gen = []
    for _ in range(n_new):
        gen.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        llm.eval([gen[-1]])
    out.append({"tokens": list(tokens), "logits": logits, "greedy": gen})
print(json.dumps(out))
"""


def run_llamacpp(path: Path, mode: str, items: list, n_new: int) -> list[dict]:
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", _SCRIPT, str(path), mode, str(n_new)],
                          input=json.dumps(items), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow  # two minutes: twelve prompts through both engines
def test_greedy_tokens_equal_llamacpp_on_the_bundled_model(bundled, capsys):
    ref = run_llamacpp(bundled, "chat", PROMPTS, 32)
    stage = Stage.load(bundled, threads=2, kv=SAME_KV)
    agree, divergences, cosines, linf = 0, [], [], []
    for r in ref:
        ours = generate(stage, r["tokens"], 32)
        d = first_divergence(ours, r["greedy"])
        divergences.append(d)
        agree += d is None
        with stage.open_session() as s:
            logits = stage.forward(s, np.array(r["tokens"]))[0]
        cosines.append(compare(logits, np.array(r["logits"])).cosine)
        linf.append(float(np.abs(logits - np.array(r["logits"])).max()))
    with capsys.disabled():
        print(f"\nllama.cpp greedy agreement {agree}/{len(ref)}, first divergence {divergences}, "
              f"prompt logits cosine min {min(cosines):.6f}, max |delta| {max(linf):.3g}")
    assert min(cosines) > 0.9999
    assert agree >= 0.8 * len(ref)


def test_llamacpp_runs_generated_qwen3moe_with_our_logits(models, capsys):
    prompts = [list(np.random.default_rng(i).integers(0, 49152, 12)) for i in range(5)]
    prompts = [[int(t) for t in p] for p in prompts]
    for name in ("moe", "moe_q8"):
        ref = run_llamacpp(models[name], "tokens", prompts, 0)
        stage = Stage.load(models[name], threads=1, kv=SAME_KV)
        got, want = [], []
        for p, r in zip(prompts, ref, strict=True):
            with stage.open_session() as s:
                got.append(stage.forward(s, np.array(p))[0])
            want.append(np.array(r["logits"]))
        m = compare(np.array(got), np.array(want))
        with capsys.disabled():
            print(f"\n{name}: llama.cpp vs kvasird logits cosine {m.cosine:.6f}, "
                  f"top-1 {m.top1:.2f}, max |delta| "
                  f"{np.abs(np.array(got) - np.array(want)).max():.3g}")
        assert m.cosine > 0.9999


def ours_and_llamacpp(path: Path, prompts: list[list[int]], n_new: int):
    """(our last-position logits, theirs, our greedy tokens, theirs) on the same token ids."""
    ref = run_llamacpp(path, "tokens", prompts, n_new)
    stage = Stage.load(path, threads=1, kv=SAME_KV)
    try:
        got = []
        for p in prompts:
            with stage.open_session() as s:
                got.append(stage.forward(s, np.array(p))[0])
        greedy = [generate(stage, p, n_new) for p in prompts]
    finally:
        stage.close()
    return (np.array(got), np.array([r["logits"] for r in ref]), greedy,
            [r["greedy"] for r in ref])


def random_prompts(n: int, length: int) -> list[list[int]]:
    return [[int(t) for t in np.random.default_rng(i).integers(0, 49152, length)]
            for i in range(n)]


@pytest.mark.parametrize("arch, dtype", [(a, t) for a in ("qwen3", "mixtral", "gemma3", "qwen35",
                                                   "qwen35moe", "gpt-oss")
                                         for t in ("f32", "q8_0")]
                         + [("gemma3", "softcap"), ("gpt-oss", "mxfp4")])
def test_new_architectures_give_llamacpp_logits_and_greedy_tokens(arch_models, arch, dtype,
                                                                   capsys, tmp_path):
    """qwen3, llama with experts, gemma3 and gpt-oss (12-token prompts: past their
    4-position sliding windows; gpt-oss with YaRN, sinks and MXFP4 experts too) and the
    Qwen3.5 hybrids (the prompt's delta-net state from one prefill, then 8 decode steps),
    as llama.cpp itself computes them (not our oracle)."""
    if dtype == "softcap":
        from kvasird_dev.testmodels import make_model

        path = make_model(tmp_path / "capped.gguf", arch="gemma3", n_layer=3, logit_softcap=3.0)
    else:
        path = arch_models[arch, dtype]
    got, want, ours, theirs = ours_and_llamacpp(path, random_prompts(5, 12), 8)
    m = compare(got, want)
    delta = float(np.abs(got - want).max())
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    with capsys.disabled():
        print(f"\n{arch} {dtype}: llama.cpp vs kvasird logits cosine {m.cosine:.8f}, "
              f"top-1 {m.top1:.2f}, max |delta| {delta:.3g}, greedy {agree}/{len(ours)}")
    assert m.top1 == 1.0
    assert delta < 1e-4 * np.abs(want).max()
    assert ours == theirs


_LAST_LOGITS = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, n = sys.argv[1], int(sys.argv[2])
tokens = json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_ctx=n, n_threads=1, n_batch=512, verbose=False)
llm.eval(tokens)
print(json.dumps(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).tolist()))
"""


def test_a_k_quant_prompt_longer_than_a_piece_gives_llamacpp_logits_bit_for_bit(
        tmp_path: Path) -> None:
    """Llama's Q4_K_M mix (the repacked Q4_K products, Q6_K's tiled ones) and a 150-token
    prompt: three pieces of many rows, the last layer's FFN and the head only on the last
    row as llama.cpp computes them: the logits are llama.cpp's bit for bit. (With the
    last layer's FFN on all 22 rows of the last piece, its Q6_K down projection over
    8192 inputs, Llama-3.2-1B's n_ff, rounded apart from llama.cpp's one-row product.)"""
    from kvasird_dev.testmodels import make_model

    path = make_model(tmp_path / "q4km.gguf", arch="llama", n_layer=3, n_embd=512,
                      n_head=8, n_head_kv=2, head_dim=64, n_ff=8192, dtype="q4_k_m", seed=5)
    prompt = np.random.default_rng(2).integers(0, 49152, 150)
    stage = Stage.load(path, threads=1, kv=SAME_KV)
    try:
        with stage.open_session() as s:
            ours = stage.forward(s, prompt)[0]
    finally:
        stage.close()
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", _LAST_LOGITS, str(path), "512"],
                          input=json.dumps(prompt.tolist()), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.array_equal(ours, np.array(json.loads(done.stdout), np.float32))


@pytest.mark.slow  # a minute: 32k positions through both engines
def test_a_32k_token_context_gives_llamacpp_logits(tmp_path: Path) -> None:
    """A model that declares a 32,768-token context, filled to its last position in one
    prompt: computed in 64-row pieces (512 graphs, none larger than a piece's), the last
    position's logits are llama.cpp's bit for bit."""
    from kvasird_dev.testmodels import make_model

    n = 32768
    path = make_model(tmp_path / "long.gguf", arch="llama", n_layer=2, context_length=n,
                      dtype="q8_0", seed=3)
    prompt = np.random.default_rng(0).integers(0, 49152, n)
    stage = Stage.load(path, threads=1, kv=KVSpec(n_slots=n, dtype="f16"))
    try:
        with stage.open_session() as s:
            ours = stage.forward(s, prompt)[0]
        assert s.n_past == n
    finally:
        stage.close()
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", _LAST_LOGITS, str(path), str(n)],
                          input=json.dumps(prompt.tolist()), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.array_equal(ours, np.array(json.loads(done.stdout), np.float32))
