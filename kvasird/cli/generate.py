"""``kvasird generate``: a prompt through the running daemon's swarm routing, tokens out.

The daemon routes and generates (POST /v0/generate on its admin API, token ids in, an
NDJSON token stream out); this command tokenizes with the model's own tokenizer (from
the GGUF at ``--model PATH`` or the daemon's ``[market] model``; for a model named by id
or label, from its manifest in this home's shard store) and prints text as it arrives.
``--tokens 1,2,3`` sends ids as they are and prints ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from kvasird.cli import home_of
from kvasird.config import load
from kvasird.errors import DaemonNotRunning
from kvasird.home import Home
from kvasird.inference.api import GenerationError
from kvasird.model.manifest import Manifest
from kvasird.model.ref import ModelRef
from kvasird.model.store import ShardStore, StoreError
from kvasird.text.chat import ChatTemplate, Message
from kvasird.text.tokenizer import Tokenizer


class GenerateError(GenerationError):
    """The daemon could not generate (no route, busy, unknown model, bad input)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text through the swarm from this node")
    p.add_argument("prompt", nargs="?", default="", help="prompt text (tokenized here)")
    p.add_argument(
        "--model",
        default="",
        help="model name, id, id prefix or GGUF path (default: the model this node serves)",
    )
    p.add_argument(
        "--tokens",
        default="",
        help="prompt as comma-separated token ids; prints ids instead of text",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not (args.tokens or args.prompt.strip()):
        raise GenerateError(
            "the prompt is empty: give the text to continue, e.g. "
            '`kvasird generate "Once upon a time"`, or --tokens 1,2,3'
        )
    home = home_of(args)
    tokenizer, model = _model(home, args.model, tokenize=not args.tokens)
    prompt = _prompt(args, tokenizer)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
    }
    if tokenizer is not None and tokenizer.special.eos is not None:
        body["stop"] = [tokenizer.special.eos]
    decoder = tokenizer.stream() if tokenizer else None
    for event in _stream(home, body):
        if "token" in event:
            out = decoder.feed(event["token"]) if decoder else f"{event['token']} "
            print(out, end="", flush=True)
        elif "finished" in event:
            print(decoder.finish() if decoder else "")
            print(
                f"[{event['finished']}: {event['prompt_tokens']} prompt + "
                f"{event['completion_tokens']} generated tokens]",
                file=sys.stderr,
            )
    return 0


def _model(home: Home, name: str, tokenize: bool) -> tuple[Tokenizer | None, str]:
    """(the model's tokenizer, None unless ``tokenize``; the model name the daemon resolves)."""
    path = Path(name).expanduser()
    if name and path.is_file():
        return (Tokenizer.from_gguf(path) if tokenize else None), Manifest.from_gguf(path).model_id
    if not tokenize:
        return None, name
    if name:
        return _stored_tokenizer(home, name), name
    served = load(home.config).market.model
    if not served:
        return None, name
    ref = ModelRef.parse(served, where="market.model")
    return (
        _stored_tokenizer(home, ref.value) if ref.from_peers else Tokenizer.from_gguf(ref.gguf())
    ), name


def _stored_tokenizer(home: Home, name: str) -> Tokenizer:
    """The tokenizer of a model named by id, id prefix or label, from its manifest in the
    shard store: every node that holds any part of the model (or learnt of it from the
    peers serving it) has the manifest, and the manifest has the GGUF's metadata."""
    with ShardStore.open(home) as store:
        try:
            model_id = store.resolve(name)
            manifest = store.manifest(model_id)
        except StoreError as exc:
            raise GenerateError(
                f"cannot tokenize for {name!r}: {exc} (a node has a model's "
                "manifest once it finds a peer serving it; or pass --model "
                "FILE.gguf, or --tokens 1,2,3)"
            ) from None
    return Tokenizer.from_metadata(manifest.metadata, f"model {model_id[:16]}")


def _prompt(args: argparse.Namespace, tokenizer: Tokenizer | None) -> list[int]:
    if args.tokens:
        try:
            return [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise GenerateError(
                f"--tokens {args.tokens!r}: give comma-separated integers"
            ) from None
    if tokenizer is None:
        raise GenerateError(
            "no tokenizer: this node serves no model; pass --model PATH.gguf or --tokens 1,2,3"
        )
    text = (
        ChatTemplate.of(tokenizer).render([Message("user", args.prompt)])
        if args.chat
        else args.prompt
    )
    return tokenizer.encode(text, special=args.chat)


def _stream(home: Home, body: dict[str, Any]):  # noqa: ANN202 - a generator of events
    url = home.admin_address()
    if url is None:
        raise DaemonNotRunning(
            f"no daemon is running for {home.root}: start it with `kvasird --home {home.root} run`"
        )
    try:
        with httpx.stream("POST", url + "/v0/generate", json=body, timeout=300) as resp:
            if resp.status_code != 200:
                raise GenerateError(
                    f"the daemon could not generate: "
                    f"{json.loads(resp.read()).get('error', resp.status_code)}"
                )
            for line in resp.iter_lines():
                event = json.loads(line)
                if "error" in event:
                    raise GenerateError(f"generation stopped: {event['error']}")
                yield event
    except httpx.HTTPError as exc:
        raise DaemonNotRunning(
            f"the daemon for {home.root} does not answer at {url} ({exc})"
        ) from None
