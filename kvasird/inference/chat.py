"""The chat template: messages -> the prompt text the model was trained on.

The template is the GGUF's own ``tokenizer.chat_template`` (Jinja), rendered in
Jinja's immutable sandbox: the template comes from a model file someone else made,
so it may read the messages but never touch Python objects or the filesystem. A
model without a template gets ChatML, llama.cpp's fallback.

An assistant message at the end is a *prefill* (Anthropic's term): the reply
continues it. It is rendered as the text after the generation prompt rather than as
a closed turn, so the model picks up mid-sentence.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvasird.errors import ModelError
from kvasird.inference.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class ChatTemplateError(ModelError):
    """The model's chat template failed on these messages (the message says why)."""


@dataclass(frozen=True)
class Message:
    role: str
    """"system", "user" or "assistant"."""
    content: str
    """The message text."""


class ChatTemplate:
    """A compiled chat template and the special-token texts it may refer to."""

    def __init__(self, source: str | None, bos: str = "", eos: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source or CHATML)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None
        self._bos, self._eos = bos, eos

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatTemplate:
        sp = tokenizer.special

        def text(token: int | None) -> str:
            return tokenizer.tokens[token] if token is not None else ""
        return cls(tokenizer.chat_template, text(sp.bos), text(sp.eos))

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt for ``messages``, ending where the assistant's reply begins."""
        prefill = ""
        if messages and messages[-1].role == "assistant":
            prefill, messages = messages[-1].content, messages[:-1]
        plain = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self._template.render(messages=plain, add_generation_prompt=True,
                                         bos_token=self._bos, eos_token=self._eos)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") \
                from None
        return text + prefill


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)
