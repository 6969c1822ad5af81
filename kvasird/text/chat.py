"""The chat template: messages -> the prompt text the model was trained on.

The template is the GGUF's own ``tokenizer.chat_template`` (Jinja), rendered in
Jinja's immutable sandbox: the template comes from a model file someone else made,
so it may read the messages but never touch Python objects or the filesystem. A
model without a template gets ChatML, llama.cpp's fallback.

An assistant message at the end is a *prefill* (Anthropic's term): the reply
continues it. It is rendered as the text after the generation prompt rather than as
a closed turn, so the model picks up mid-sentence.

Templates are written against Hugging Face transformers' renderer, so they get its
globals and its ``tojson`` (``ensure_ascii``, ``indent``, ``separators``, ``sort_keys``).
Mistral's refuse a call id that is not 9 letters or digits: for them each id is given as
such an id derived from it, the same for a call and for its result.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvasird.errors import ModelError
from kvasird.text.tokenizer import Tokenizer
from kvasird.text.toolcalls.calls import Tool, ToolCall
from kvasird.text.toolcalls.hermes import Format
from kvasird.text.toolcalls.registry import format_of, reads_tools

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


NINE_CHARACTER_IDS = re.compile(r"id\s*\|\s*length\s*!=\s*9")
"""How Mistral's templates refuse a call id that is not 9 characters long."""


class ChatTemplateError(ModelError):
    """The model's chat template failed on these messages (the message says why)."""


@dataclass(frozen=True)
class Message:
    role: str
    """"system", "user", "assistant" or "tool" (a tool's result)."""
    content: str
    """The message text."""
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant's calls of tools (kvasird.text.toolcalls)."""
    tool_call_id: str = ""
    """A tool result: the call it answers."""
    name: str = ""
    """A tool result: the tool's name."""


class ChatTemplate:
    """A compiled chat template and the special-token texts it may refer to."""

    def __init__(self, source: str | None, bos: str = "", eos: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source or CHATML)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None
        self._bos, self._eos = bos, eos
        self._short_ids = bool(source and NINE_CHARACTER_IDS.search(source))
        self.source = source

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatTemplate:
        sp = tokenizer.special

        def text(token: int | None) -> str:
            return tokenizer.tokens[token] if token is not None else ""

        return cls(tokenizer.chat_template, text(sp.bos), text(sp.eos))

    @property
    def tool_format(self) -> Format:
        """How this model writes tool calls (kvasird.text.toolcalls.registry.format_of)."""
        return format_of(self.source)

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] = (),
        options: Mapping[str, str | bool] | None = None,
    ) -> str:
        """The prompt for ``messages``, ending where the assistant's reply begins. ``tools``
        go to a template that reads them, else into the system message (tools module);
        ``options`` are variables a template may read (gpt-oss's ``reasoning_effort``), which
        the others ignore."""
        prefill = ""
        if messages and messages[-1].role == "assistant" and not messages[-1].tool_calls:
            prefill, messages = messages[-1].content, messages[:-1]
        native = reads_tools(self.source)
        names = {c.id: c.name for m in messages for c in m.tool_calls}
        plain = [_as_dict(m, native, names, self._short_ids) for m in messages]
        if (tools or any(m.tool_calls or m.role == "tool" for m in messages)) and not native:
            plain = self.tool_format.plain(plain)
            if tools:
                text = self.tool_format.system_text(tools)
                if plain and plain[0]["role"] == "system":
                    plain[0] = {**plain[0], "content": plain[0]["content"] + "\n\n" + text}
                else:
                    plain.insert(0, {"role": "system", "content": text})
        extra: dict[str, Any] = {**(options or {})}
        if tools and native:
            extra["tools"] = [t.openai() for t in tools]
        try:
            text = self._template.render(
                messages=plain,
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
                **extra,
            )
        except (TemplateError, TypeError, ValueError) as exc:  # a filter given the wrong type
            raise ChatTemplateError(
                f"the model's chat template rejected the messages: {exc}"
            ) from None
        return text + prefill


def _as_dict(m: Message, native: bool, names: dict[str, str], short_ids: bool) -> dict[str, Any]:
    """A message as templates read it: OpenAI's shape for one that knows tools. A result
    that does not name its tool (Anthropic's never do) is named after its call."""

    def call_id(text: str) -> str:
        return _nine_characters(text) if short_ids else text

    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = (
            [
                {
                    "id": call_id(c.id),
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments or "{}")},
                }
                for c in m.tool_calls
            ]
            if native
            else list(m.tool_calls)
        )
    if m.role == "tool":
        out.update(
            tool_call_id=call_id(m.tool_call_id), name=m.name or names.get(m.tool_call_id, "")
        )
    return out


def _nine_characters(call_id: str) -> str:
    """A call id as Mistral's templates take one: 9 letters or digits."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
