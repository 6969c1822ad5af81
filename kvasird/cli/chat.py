"""``kvasird chat``: talk to a model through a gateway, the reply streamed as it is generated.

The gateway is the running daemon's (from its admin API) unless ``--url`` names
another. It speaks the OpenAI chat API with ``stream: true``, exactly as any other
client would, so it also checks that the gateway works end to end.

On a terminal, lines are edited and recalled as in a shell (prompt_toolkit), the lines
typed kept in the node's home for the next chat; from a pipe they are read as they come.
A line that starts with "/" is a command (COMMANDS) and never reaches the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from kvasird.admin import client
from kvasird.cli import home_of
from kvasird.inference.api import GenerationError
from kvasird.model.names import named_by

if TYPE_CHECKING:
    from prompt_toolkit import PromptSession

TIMEOUT = httpx.Timeout(10.0, read=600.0)
HISTORY = "chat_history"
"""The file in the node's home that keeps the lines typed, for the arrow keys."""
PROMPT = "> "


class ChatError(GenerationError):
    """The gateway refused the request or could not be reached."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model through a gateway (streaming)")
    p.add_argument("prompt", nargs="?", help="ask once and exit (default: interactive)")
    p.add_argument("--url", help="gateway URL (default: the running daemon's gateway)")
    p.add_argument(
        "--model", help="model name, id or id prefix (default: the gateway's first model)"
    )
    p.add_argument("--system", help="system prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    url = (args.url or daemon_gateway(args)).rstrip("/")
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        models = listed_models(http)
        chat = Chat(http, args, pick(models, args.model, url) if args.model else models[0])
        if args.prompt is not None:
            chat.turn(args.prompt)
            return 0
        say(f"chatting with {chat.model.name} at {url}; /help lists the commands, Ctrl-D leaves")
        chat.loop(_reader(args))
    return 0


@dataclass(frozen=True)
class Model:
    """A model as the gateway lists it."""

    id: str
    """The model id (64 hex digits), which requests carry: it names one model on every
    node."""
    name: str
    """Its name on the network ("smollm2:135m-instruct")."""

    @classmethod
    def listed(cls, entry: dict[str, Any]) -> Model:
        """A /v1/models entry: ``id`` is the name (``model_id`` the content id) on gateways
        since names are ``family:tag``, the content id on older ones."""
        return cls(
            str(entry.get("model_id") or entry["id"]),
            str(entry.get("name") or entry.get("label") or entry["id"]),
        )

    def answers_to(self, text: str) -> bool:
        """Whether ``text`` names this model: its name, id, an 8+ digit id prefix or the
        name's slug (``names.named_by``)."""
        return named_by(text, self.id, self.name)

    def __str__(self) -> str:
        return f"{self.name} (id {self.id[:12]})"


class Chat:
    """One conversation through a gateway: the messages so far and the model they go to."""

    def __init__(self, http: httpx.Client, args: argparse.Namespace, model: Model) -> None:
        self.http, self.args, self.model = http, args, model
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages[:] = (
            [{"role": "system", "content": self.args.system}] if self.args.system else []
        )

    def loop(self, read: Callable[[], str | None]) -> None:
        """Read lines until /quit or the end of input: commands act, the rest is sent. A
        refusal is told and the chat goes on, the conversation as it was."""
        while (line := read()) is not None:
            text = line.strip()
            try:
                if text.startswith("//"):
                    self.turn(text[1:])
                elif text.startswith("/"):
                    if not self.command(*text.split(maxsplit=1)):
                        return
                elif text:
                    self.turn(line)
            except ChatError as exc:
                say(f"{exc} (the conversation is as it was before that line)")

    def command(self, name: str, arg: str = "") -> bool:
        """Run a /command; False when it ends the chat. Nothing here reaches the model."""
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            say("\n".join(f"  {usage:14} {what}" for usage, what in COMMANDS))
        elif name == "/reset":
            self.reset()
            say("the conversation is forgotten")
        elif name == "/model":
            self.switch(arg)
        else:
            say(
                f"there is no command {name}: /help lists them (start a message with // to "
                "send one that begins with /)"
            )
        return True

    def switch(self, name: str) -> None:
        models = listed_models(self.http)
        if not name:
            say(
                f"chatting with {self.model}; the gateway serves: "
                + ", ".join(m.name for m in models)
            )
            return
        found = next((m for m in models if m.answers_to(name)), None)
        if found is None:
            say(
                f"the gateway serves no model {name!r}: it serves "
                + ", ".join(m.name for m in models)
                + " (`/model NAME` switches)"
            )
            return
        self.model = found
        say(f"now chatting with {found}")

    def turn(self, text: str) -> None:
        """Send ``text`` with the conversation so far and print the reply as it streams."""
        self.messages.append({"role": "user", "content": text})
        body = {
            "model": self.model.id,
            "messages": self.messages,
            "stream": True,
            "temperature": self.args.temperature,
            "max_tokens": self.args.max_tokens,
            "seed": self.args.seed,
        }
        reply = []
        try:
            for delta in _deltas(self.http, body):
                reply.append(delta)
                print(delta, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        except ChatError:
            self.messages.pop()
            if reply:
                print()
            raise
        print()
        self.messages.append({"role": "assistant", "content": "".join(reply)})


COMMANDS = (
    ("/help", "this list"),
    ("/reset", "forget the conversation (the system prompt stays)"),
    ("/model [NAME]", "show the model, or switch to NAME (a model the gateway serves)"),
    ("/quit", "leave (also /exit or Ctrl-D)"),
)
"""Every command and its line in /help."""


def say(text: str) -> None:
    """A line about the chat, not of it: on stderr, so stdout carries only the replies."""
    print(text, file=sys.stderr, flush=True)


def _reader(args: argparse.Namespace) -> Callable[[], str | None]:
    """Lines from the terminal with editing and history, or plain lines from a pipe."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return _plain_line
    from prompt_toolkit import PromptSession  # deferred: only a terminal needs it
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    home = home_of(args, required=False).root
    history = FileHistory(str(home / HISTORY)) if home.is_dir() else InMemoryHistory()
    return edited_lines(PromptSession(history=history))


def edited_lines(session: PromptSession[str]) -> Callable[[], str | None]:
    """Lines read by ``session``: Ctrl-C drops the line being typed, Ctrl-D ends."""

    def read() -> str | None:
        while True:
            try:
                return session.prompt(PROMPT)
            except KeyboardInterrupt:
                continue
            except EOFError:
                return None

    return read


def _plain_line() -> str | None:
    try:
        return input()
    except EOFError:
        return None


def listed_models(http: httpx.Client) -> list[Model]:
    try:
        models = [Model.listed(m) for m in http.get("/v1/models").json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise ChatError(f"cannot list the gateway's models at {http.base_url} ({exc})") from None
    if not models:
        raise ChatError("the gateway serves no model yet: wait until `/health` says ok")
    return models


def pick(models: list[Model], name: str, url: str) -> Model:
    found = next((m for m in models if m.answers_to(name)), None)
    if found is None:
        raise ChatError(
            f"the gateway at {url} serves no model {name!r}; it serves "
            + ", ".join(str(m) for m in models)
            + ": pass one of those to --model"
        )
    return found


def _deltas(http: httpx.Client, body: dict[str, Any]) -> Iterator[str]:
    try:
        yield from _stream(http, body)
    except httpx.HTTPError as exc:
        raise ChatError(
            f"the gateway at {http.base_url} cannot be reached ({exc}): is the "
            "daemon still running?"
        ) from None


def _stream(http: httpx.Client, body: dict[str, Any]) -> Iterator[str]:
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


def daemon_gateway(args: argparse.Namespace, flag: str = "--url") -> str:
    """The running daemon's gateway URL (chat's and pay's default)."""
    url = client.get(home_of(args), "/v0/status").get("gateway")
    if not url:
        raise ChatError(
            f"the running daemon has no gateway: set [gateway] enabled = true, or pass {flag}"
        )
    return str(url)


def _message(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message", err))
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:300]
