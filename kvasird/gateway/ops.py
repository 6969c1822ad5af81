"""llama-server's own endpoints that tools built for it call: /tokenize, /detokenize,
/apply-template and /props, shaped as llama-server shapes them.

    POST /tokenize        {"content", "add_special": false, "parse_special": true,
                           "with_pieces": false} -> {"tokens": [id, ...]}, or with pieces
                           [{"id", "piece"}, ...], a piece that is not whole UTF-8 given
                           as its list of bytes
    POST /detokenize      {"tokens": [id, ...]} -> {"content"}
    POST /apply-template  a chat completion's body ("messages", "tools",
                           "reasoning_effort") -> {"prompt"}: the text the chat endpoint
                           tokenizes, so the two can never disagree
    GET  /props           the model's context, the chat defaults, the template, the limits

Each takes the model as ``model`` (in the body; for /props in the query), as the gateway's
other endpoints do, or serves the gateway's model when none is named: llama-server serves
one model and its clients name none. ``parse_special`` defaults to the gateway's
``[gateway] parse_special``, so /tokenize counts a raw prompt as /v1/completions does.
``add_special`` adds BOS where the model's tokenizer adds it (a model that also ends its
input with EOS, as llama.cpp's ``add_eos`` does, is not known to kvasird's tokenizer).

Of /props, what has no meaning on a network of peers is left out: the slots' state and
ids, ``model_path`` as a file (here it is the model's name on the network: a gateway may
hold no byte of the model, and a path would tell a stranger about the node's disk), LoRA,
speculative and multimodal settings, ``media_marker``, ``chat_template_caps``, and the
POST /props that changes settings (those are kvasird.toml's).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvasird import __version__
from kvasird.gateway import openai
from kvasird.gateway.body import Fields, read_json
from kvasird.gateway.errors import BadRequest
from kvasird.gateway.service import Gateway
from kvasird.gateway.tools import openai_tool_use
from kvasird.inference.api import ModelInfo
from kvasird.text.chat import CHATML, ChatTemplate
from kvasird.text.tokenizer import Tokenizer

LLAMA_NAMES = {"repetition_penalty": "repeat_penalty"}
"""Sampling settings llama-server names otherwise (the rest share their names)."""


async def tokenize(gw: Gateway, request: Request) -> JSONResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    _, tok, _ = _served(gw, f.string("model", None))
    ids = tok.encode(
        f.string("content"), special=f.boolean("parse_special", gw.config.parse_special)
    )
    bos = tok.special.bos
    if f.boolean("add_special", False) and tok.special.add_bos and bos is not None:
        ids.insert(0, bos)
    if not f.boolean("with_pieces", False):
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": t, "piece": _piece(tok, t)} for t in ids]})


async def detokenize(gw: Gateway, request: Request) -> JSONResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    _, tok, _ = _served(gw, f.string("model", None))
    ids = f.array("tokens")
    for i, t in enumerate(ids):
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tok.n_vocab):
            raise BadRequest(
                f"`tokens[{i}]` must be a token id of the model, 0..{tok.n_vocab - 1}, got {t!r}",
                f"tokens[{i}]",
            )
    return JSONResponse({"content": tok.decode(ids)})


async def apply_template(gw: Gateway, request: Request) -> JSONResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    _, _, template = _served(gw, f.string("model", None))
    use = openai_tool_use(f, template)
    reasoning = gw.reasoning(template, f.string("reasoning_effort", None), "reasoning_effort")
    prompt = gw.chat_text(template, openai.messages(f), "messages", use.tools, reasoning)
    return JSONResponse({"prompt": prompt})


async def props(gw: Gateway, request: Request) -> JSONResponse:
    info, tok, template = _served(gw, request.query_params.get("model"))
    return JSONResponse(
        {
            "default_generation_settings": {
                "n_ctx": info.context_length,
                "is_processing": gw.stats.in_flight > 0,
                "params": _defaults(gw, info),
            },
            "total_slots": gw.config.max_concurrent,
            "model_path": info.label,
            "model_alias": info.label,
            "model_id": info.model_id,
            "chat_template": template.source or CHATML,
            "bos_token": _token_text(tok, tok.special.bos),
            "eos_token": _token_text(tok, tok.special.eos),
            "modalities": {"vision": False, "audio": False},
            "build_info": f"kvasird {__version__}",
        }
    )


def _served(gw: Gateway, name: str | None) -> tuple[ModelInfo, Tokenizer, ChatTemplate]:
    """The model a request names, else the gateway's first (Gateway.resolve says what is
    wrong: not ready yet, or no such model)."""
    if name is None:
        models = gw.models()
        name = models[0].model_id if models else ""
    return gw.resolve(name)


def _defaults(gw: Gateway, info: ModelInfo) -> dict[str, Any]:
    """What a chat completion that sets nothing samples with, in llama-server's names."""
    cap = gw.config.max_tokens
    params = asdict(openai.sampling(Fields({}), cap, -1, defaults=info.sampling).params)
    seed = params.pop("seed")
    params.pop("grammar")
    return {
        **{LLAMA_NAMES.get(k, k): v for k, v in params.items()},
        "seed": -1 if seed is None else seed,
        "n_predict": cap,
        "max_tokens": cap,
        "stop": [],
        "n_probs": 0,
        "ignore_eos": False,
        "stream": False,
    }


def _piece(tok: Tokenizer, token: int) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (half a character)."""
    raw = tok.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _token_text(tok: Tokenizer, token: int | None) -> str:
    return tok.tokens[token] if token is not None else ""
