"""/v1/embeddings on a 3-node local network as `kvasird localnet up` builds it (#39): the
bundled model split among three daemons, payments on a local chain (the operator's own
requests charged per input token and paid to the peers). Through the official openai SDK
and LangChain's OpenAIEmbeddings, the vectors are the whole model's final-norm hidden
states, mean-pooled and normalized: equal to llama.cpp's embeddings of the same GGUF
(cosine >= 0.9999) where llama.cpp is built, and always to one stage holding the whole
model."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage
from kvasird.localnet import LocalNet
from kvasird.localnet.demo import serve_model, wait_served
from kvasird.model.bundled import bundled_path
from kvasird.text.tokenizer import Tokenizer
from tests.compute.test_llamacpp import PROMPTS

pytestmark = pytest.mark.slow

LLAMACPP_PYTHON = Path(__file__).resolve().parents[2] / ".cache/llamacpp-venv/bin/python"
TEXTS = PROMPTS[:20]
_LLAMACPP = """
import json, sys
from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama
llm = Llama(model_path=sys.argv[1], embedding=True, pooling_type=LLAMA_POOLING_TYPE_MEAN,
            n_ctx=512, n_threads=2, verbose=False)
print(json.dumps([llm.embed(t, normalize=True) for t in json.loads(sys.stdin.read())]))
"""


@pytest.fixture(scope="module")
def gateway(module_tmp: Callable[[str], Path]) -> Iterator[str]:
    with LocalNet(module_tmp("net"), 3, chain=True) as net:
        serve_model(net, bundled_path())
        net.up()
        yield wait_served(net)


@pytest.fixture(scope="module")
def whole_model() -> list[np.ndarray]:
    """Each text's embedding by one stage holding the whole bundled model."""
    tok = Tokenizer.from_gguf(bundled_path())
    stage = Stage.load(bundled_path(), threads=1, kv=KVSpec(n_slots=512))
    try:
        out = []
        for text in TEXTS:
            ids = ([tok.special.bos] if tok.special.add_bos else []) + tok.encode(text)
            with stage.open_session() as s:
                v = stage.forward(s, np.asarray(ids), 0, "embd").astype(np.float64).mean(axis=0)
            out.append(v / np.linalg.norm(v))
        return out
    finally:
        stage.close()


def cosines(got: list[list[float]], want: list[np.ndarray]) -> list[float]:
    return [float(np.dot(np.asarray(g) / np.linalg.norm(g), w)) for g, w in zip(got, want,
                                                                                strict=True)]


def test_the_sdk_embeds_twenty_texts_through_three_nodes_as_the_whole_model(
        gateway: str, whole_model: list[np.ndarray]) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="-", max_retries=0, timeout=300)
    (model,) = [m.id for m in client.models.list()]
    raw = client.embeddings.with_raw_response.create(model=model, input=TEXTS)
    got = raw.parse()
    assert raw.headers["x-kvasir-pooling"] == "mean"
    assert raw.headers["x-kvasir-paid-by"].startswith("operator")  # charged per input token
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    assert min(cosines([d.embedding for d in got.data], whole_model)) >= 0.9999
    assert all(abs(np.linalg.norm(d.embedding) - 1) < 1e-4 for d in got.data)
    tok = Tokenizer.from_gguf(bundled_path())
    assert got.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS) + (
        len(TEXTS) if tok.special.add_bos else 0)

    # base64 (the openai SDK's own default for its python client), token ids, one string
    b64 = httpx.post(f"{gateway}/v1/embeddings", timeout=300, json={
        "model": model, "input": TEXTS[0], "encoding_format": "base64"}).json()
    v = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
    assert np.allclose(v, got.data[0].embedding, atol=1e-6)
    ids = tok.encode(TEXTS[1])
    ids = ([tok.special.bos] if tok.special.add_bos else []) + ids
    by_ids = client.embeddings.create(model=model, input=[ids])
    assert np.allclose(by_ids.data[0].embedding, got.data[1].embedding, atol=1e-5)


def test_langchain_openai_embeddings_work_against_the_network(
        gateway: str, whole_model: list[np.ndarray]) -> None:
    model = httpx.get(f"{gateway}/v1/models", timeout=10).json()["data"][0]["id"]
    # an OpenAI-compatible server's settings, as LangChain documents them: the texts are
    # sent as text (not cut into OpenAI's own tokens first)
    emb = OpenAIEmbeddings(model=model, base_url=f"{gateway}/v1", api_key="-",  # type: ignore[arg-type]
                           check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(TEXTS[:5])
    query = emb.embed_query(TEXTS[0])
    assert min(cosines(docs, whole_model[:5])) >= 0.9999
    assert cosines([query], whole_model[:1])[0] >= 0.9999


def test_bad_embedding_requests_are_refused_with_what_to_fix(gateway: str) -> None:
    model = httpx.get(f"{gateway}/v1/models", timeout=10).json()["data"][0]["id"]
    for body, field in [({"input": ""}, "input"), ({"input": []}, "input"),
                        ({"input": "x", "dimensions": 7}, "dimensions"),
                        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": [[1, 2], "x", 3]}, "input[2]")]:
        r = httpx.post(f"{gateway}/v1/embeddings", json={"model": model, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, r.text


@pytest.mark.llamacpp
@pytest.mark.skipif(not LLAMACPP_PYTHON.exists(), reason="run native/llamacpp to build llama.cpp")
def test_the_networks_embeddings_equal_llamacpps(gateway: str) -> None:
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", _LLAMACPP, str(bundled_path())],
                          input=json.dumps(TEXTS), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = [np.asarray(v, np.float64) for v in json.loads(done.stdout)]
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="-", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    ours = [d.embedding for d in client.embeddings.create(model=model, input=TEXTS).data]
    got = cosines(ours, [t / np.linalg.norm(t) for t in theirs])
    print(f"\nllama.cpp vs the network: cosine min {min(got):.6f}")
    assert min(got) >= 0.9999
