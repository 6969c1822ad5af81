"""``kvasird chat``: talk to a model through a gateway, the reply streamed as it is generated.

The gateway is the running daemon's (from its admin API) unless ``--url`` names
another. It speaks the OpenAI chat API with ``stream: true``, exactly as any other
client would, so it also checks that the gateway works end to end.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx

from kvasird.admin import client
from kvasird.cli import home_of
from kvasird.inference.api import GenerationError

TIMEOUT = httpx.Timeout(10.0, read=600.0)


class ChatError(GenerationError):
    """The gateway refused the request or could not be reached."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model through a gateway (streaming)")
    p.add_argument("prompt", nargs="?", help="ask once and exit (default: interactive)")
    p.add_argument("--url", help="gateway URL (default: the running daemon's gateway)")
    p.add_argument("--model", help="model id or label (default: the gateway's first model)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    url = (args.url or _daemon_gateway(args)).rstrip("/")
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        model = args.model or _first_model(http)
        history: list[dict[str, str]] = []
        if args.system:
            history.append({"role": "system", "content": args.system})
        if args.prompt is not None:
            _turn(http, args, model, history, args.prompt)
            return 0
        print(f"chatting with {model} at {url}; /reset forgets the conversation, "
              "/exit or Ctrl-D leaves", file=sys.stderr)
        while (line := _read()) is not None:
            if line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                del history[1 if args.system else 0:]
                continue
            if line.strip():
                _turn(http, args, model, history, line)
    return 0


def _read() -> str | None:
    try:
        return input("> ")
    except EOFError:
        print(file=sys.stderr)
        return None


def _turn(http: httpx.Client, args: argparse.Namespace, model: str,
          history: list[dict[str, str]], text: str) -> None:
    history.append({"role": "user", "content": text})
    body = {"model": model, "messages": history, "stream": True,
            "temperature": args.temperature, "max_tokens": args.max_tokens, "seed": args.seed}
    reply = []
    try:
        for delta in _deltas(http, body):
            reply.append(delta)
            print(delta, end="", flush=True)
    except KeyboardInterrupt:
        print(" [interrupted]", end="")
    print()
    history.append({"role": "assistant", "content": "".join(reply)})


def _deltas(http: httpx.Client, body: dict[str, Any]) -> Iterator[str]:
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise ChatError(f"the gateway answered {resp.status_code}: {_message(resp.read())}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ChatError(f"the generation failed: {chunk['error'].get('message')}")
            for choice in chunk.get("choices", []):
                if content := choice.get("delta", {}).get("content"):
                    yield content


def _first_model(http: httpx.Client) -> str:
    try:
        models = http.get("/v1/models").json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise ChatError(f"cannot list the gateway's models at {http.base_url} ({exc})") from None
    if not models:
        raise ChatError("the gateway serves no model yet: wait until `/health` says ok")
    return str(models[0]["id"])


def _daemon_gateway(args: argparse.Namespace) -> str:
    url = client.get(home_of(args), "/v0/status").get("gateway")
    if not url:
        raise ChatError("the running daemon has no gateway: set [gateway] enabled = true, or "
                        "pass --url")
    return str(url)


def _message(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message", err))
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:300]
