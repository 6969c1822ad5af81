"""POST /v1/embeddings: OpenAI's embeddings, from the served model's hidden states.

    body ─▶ inputs: a string, a list of strings, a list of token ids, or a list of those
      ─▶ token ids (the model's tokenizer, BOS where the model's prompts start with it)
      ─▶ paid gateways: charged per input token (payment.charge, as a prompt is)
      ─▶ Generator.embed: every position's hidden state after the final norm, computed
         through the route (or the local model) in embedding sessions
      ─▶ pooled as the GGUF's pooling type says (mean, cls: the first, last), else
         [gateway] embeddings_pooling; L2-normalized, as llama-server and OpenAI return them
      ─▶ {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], usage}
         with each embedding a list of floats, or base64 of little-endian float32

That is llama.cpp's embedding (its result_norm, pooled per sequence), so the vectors equal
llama-server's for the same GGUF and pooling within the numerics contract. ``dimensions``
is accepted only as the model's own width: these models were not trained to be truncated.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from kvasird.errors import KvasirError
from kvasird.gateway import payment
from kvasird.gateway.body import Fields, read_json
from kvasird.gateway.errors import BadRequest, from_generation
from kvasird.gateway.openai import completion_prompts
from kvasird.gateway.service import Gateway, Job
from kvasird.inference.api import EmbeddingRequest, GenerationRequest, Sampling
from kvasird.text.tokenizer import Tokenizer

MAX_INPUTS = 2048
"""Inputs one request may embed (OpenAI's limit)."""
POOLING = {1: "mean", 2: "cls", 3: "last"}
"""GGUF ``{arch}.pooling_type`` values that pool a sequence into one vector."""


async def create(gw: Gateway, request: Request) -> JSONResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    info, tok, _ = gw.resolve(f.string("model"))
    inputs = _inputs(f, tok, gw.context())
    fmt = f.string("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadRequest(
            f'`encoding_format` must be "float" or "base64", got {fmt!r}', "encoding_format"
        )
    width = gw.embedding_width()
    dimensions = f.integer("dimensions", width, 1)
    if dimensions != width:
        raise BadRequest(
            f"`dimensions` {dimensions} is not this model's width ({width}): its embeddings "
            "cannot be shortened; leave `dimensions` out",
            "dimensions",
        )
    assert gw.generator is not None
    rid = f"emb-{time.monotonic_ns():x}"
    job = Job(
        GenerationRequest(info.model_id, inputs[0], Sampling(max_tokens=0), request_id=rid),
        gw.generator,
        tok,
        f.string("model"),
        prompts=inputs,
        n=len(inputs),
    )
    slot = gw.stats.admit(gw.config.max_concurrent)
    with slot:
        charge = await payment.charge(gw, dict(request.scope), job)
        began = time.monotonic()
        try:
            rows = await gw.generator.embed(EmbeddingRequest(info.model_id, inputs, rid))
        except KvasirError as exc:
            if charge is not None:
                await payment.refund(gw, charge, job, 0, time.monotonic() - began)
            raise from_generation(exc) from None
        if charge is not None:
            payment.record_work(gw, charge, job, 0, time.monotonic() - began)
    pooling = _pooling(gw)
    n = sum(len(ids) for ids in inputs)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(pool(r, pooling), fmt)}
        for i, r in enumerate(rows)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": f.string("model"),
            "usage": {"prompt_tokens": n, "total_tokens": n},
        },
        headers={"x-kvasir-pooling": pooling, **dict(_headers(charge))},
    )


def _headers(charge: payment.Charge | None) -> list[tuple[str, str]]:
    return [(k.decode(), v.decode()) for k, v in charge.headers()] if charge is not None else []


def pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    """One input's rows pooled into one unit vector (float32)."""
    if pooling == "cls":
        v = rows[0]
    elif pooling == "last":
        v = rows[-1]
    else:
        v = rows.astype(np.float64).mean(axis=0)
    norm = float(np.linalg.norm(v))
    return (np.asarray(v, np.float64) / (norm if norm > 0 else 1.0)).astype(np.float32)


def _pooling(gw: Gateway) -> str:
    """The GGUF's pooling where it says one, else the configured one."""
    kind = POOLING.get(gw.pooling_type())
    return kind if kind is not None else gw.config.embeddings_pooling


def _encoded(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode()
    return [float(x) for x in v]


def _inputs(f: Fields, tok: Tokenizer, context: int) -> tuple[tuple[int, ...], ...]:
    """`input` as token ids per input (openai.completion_prompts reads the shapes): a text
    starts with BOS where the model's prompts do, as llama.cpp tokenizes what it embeds;
    token ids are taken as they are."""
    raw = f.value.get("input")
    texts = (
        [isinstance(raw, str)]
        if not isinstance(raw, list) or _all_ids(raw)
        else [isinstance(item, str) for item in raw]
    )
    bos = [tok.special.bos] if tok.special.add_bos and tok.special.bos is not None else []
    out = []
    given = completion_prompts(f, tok, False, "input", MAX_INPUTS)
    for i, ((ids, _), text) in enumerate(zip(given, texts, strict=True)):
        where = f"input[{i}]" if len(given) > 1 else "input"
        if not ids:
            raise BadRequest(f"`{where}` is empty: send at least one token of text", where)
        ids = bos + ids if text else ids
        if len(ids) > context:
            raise BadRequest(
                f"`{where}` is {len(ids)} tokens, past the model's context of {context}: split it",
                where,
            )
        out.append(tuple(ids))
    return tuple(out)


def _all_ids(value: list[object]) -> bool:
    return bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
