"""The logit bias and the penalties side by side with llama.cpp's own samplers (optional
environment built by native/llamacpp; skipped without it).

llama.cpp's samplers run in its environment through its C API (llama_sampler_init_logit_bias,
llama_sampler_init_penalties, llama_sampler_init_greedy in one chain, as common/sampling.cpp
orders them), the prompt accepted into the chain before the first draw as llama-server does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvasird.compute.sampling import Sampler, SamplingParams
from kvasird.compute.stage import Stage, generate
from kvasird.text.tokenizer import Tokenizer
from tests.compute.test_llamacpp import LLAMACPP_PYTHON, SAME_KV
from tests.compute.test_sampling_penalties import reference

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not LLAMACPP_PYTHON.exists(),
                       reason="run native/llamacpp to build llama.cpp"),
]

_CHAIN = """
import ctypes, json, sys
import llama_cpp as L

def chain(n_vocab, case, history):
    c = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if case["bias"]:
        pairs = (L.llama_logit_bias * len(case["bias"]))(
            *[L.llama_logit_bias(t, b) for t, b in case["bias"]])
        L.llama_sampler_chain_add(c, L.llama_sampler_init_logit_bias(
            n_vocab, len(case["bias"]), pairs))
    L.llama_sampler_chain_add(c, L.llama_sampler_init_penalties(
        n_vocab, case["last_n"], case["repeat"], case["freq"], case["present"]))
    L.llama_sampler_chain_add(c, L.llama_sampler_init_greedy())
    for t in history:
        L.llama_sampler_accept(c, t)
    return c

mode, cases = sys.argv[1], json.loads(sys.stdin.read())
out = []
if mode == "logits":  # each case's logits after the chain's bias and penalties
    for case in cases:
        z = case["logits"]
        c = chain(len(z), case, case["history"])
        data = (L.llama_token_data * len(z))(*[L.llama_token_data(i, v, 0.0)
                                               for i, v in enumerate(z)])
        cur = L.llama_token_data_array(data, len(z), -1, False)
        L.llama_sampler_apply(c, ctypes.byref(cur))
        out.append({"logits": [data[i].logit for i in range(len(z))],
                    "token": data[cur.selected].id})
        L.llama_sampler_free(c)
else:  # a greedy run on a model: mode is its path
    from llama_cpp import Llama
    llm = Llama(model_path=mode, n_ctx=512, n_threads=1, n_batch=512, verbose=False)
    for case in cases:
        c = chain(llm.n_vocab(), case, case["prompt"])
        llm.reset()
        llm.eval(case["prompt"])
        gen = []
        for _ in range(case["n"]):
            gen.append(L.llama_sampler_sample(c, llm._ctx.ctx, -1))
            llm.eval([gen[-1]])
        out.append(gen)
        L.llama_sampler_free(c)
print(json.dumps(out))
"""


def llamacpp(mode: str, cases: list[dict[str, Any]]) -> list[Any]:
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", _CHAIN, mode], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def case(p: SamplingParams, **more: Any) -> dict[str, Any]:
    return {"bias": [list(b) for b in p.logit_bias], "last_n": p.penalty_last_n,
            "repeat": p.repetition_penalty, "freq": p.frequency_penalty,
            "present": p.presence_penalty, **more}


def test_bias_and_penalties_move_the_logits_as_llamacpps_samplers_do() -> None:
    """On random logits and histories (longer than the window, over a small vocabulary so
    tokens repeat), llama.cpp's chain gives the reference's logits and our greedy token."""
    rng = np.random.default_rng(7)
    params, cases = [], []
    for _ in range(300):
        p = SamplingParams(
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            presence_penalty=float(rng.uniform(-2, 2)),
            penalty_last_n=int(rng.integers(1, 100)),
            logit_bias=tuple((int(t), float(rng.uniform(-100, 100)))
                             for t in rng.choice(60, int(rng.integers(0, 4)), replace=False)))
        logits = rng.normal(0, 2, 60).astype(np.float32)
        history = rng.integers(0, 60, int(rng.integers(0, 150))).tolist()
        params.append((p, logits, history))
        cases.append(case(p, logits=logits.tolist(), history=history))
    for (p, logits, history), theirs in zip(params, llamacpp("logits", cases), strict=True):
        want = reference(logits, history, p)
        assert np.allclose(np.array(theirs["logits"], np.float32), want, rtol=1e-6, atol=1e-6)
        assert Sampler(p)(logits, history) == theirs["token"]


def chat_prompt(tok: Tokenizer, question: str) -> list[int]:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(text, special=True)


@pytest.mark.slow  # the bundled model in both engines, four greedy runs each
def test_a_greedy_run_with_a_bias_and_penalties_equals_llamacpps(bundled: Path,
                                                                capsys) -> None:
    tok = Tokenizer.from_gguf(bundled)
    prompt = chat_prompt(tok, "What is the capital of France?")
    stage = Stage.load(bundled, threads=1, kv=SAME_KV)
    try:
        plain = generate(stage, prompt, 24)
        settings = [
            SamplingParams(logit_bias=((plain[0], -100.0), (plain[3], 3.0))),
            SamplingParams(logit_bias=((tok.encode(" Paris")[0], 100.0),)),
            SamplingParams(frequency_penalty=0.8, presence_penalty=0.6, repetition_penalty=1.3,
                           logit_bias=((plain[1], -5.0),)),
            SamplingParams(frequency_penalty=1.5, presence_penalty=-0.5, penalty_last_n=512),
        ]
        ours = [generate(stage, prompt, 24, Sampler(p)) for p in settings]
    finally:
        stage.close()
    theirs = llamacpp(str(bundled), [case(p, prompt=prompt, n=24) for p in settings])
    with capsys.disabled():
        for p, a in zip(settings, ours, strict=True):
            print(f"\n{p.logit_bias} f{p.frequency_penalty} p{p.presence_penalty} "
                  f"r{p.repetition_penalty}: {tok.decode(a)!r}")
    assert all(a != plain for a in ours)
    assert ours == theirs
