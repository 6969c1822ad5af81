"""Llama 3.1 to 3.3: a call is a bare JSON object, one per reply, read whole (HeldStream)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvasird.text.toolcalls.calls import Tool, ToolCall
from kvasird.text.toolcalls.events import Args, CallClosed, CallOpened, Event, Reader, Said
from kvasird.text.toolcalls.hermes import Format


class Llama3(Format):
    """Llama 3.1+: a bare JSON object with "name" and "parameters". One call per reply: the
    templates of Llama 3.1 to 3.3 refuse an assistant message with more than one."""

    name = "llama3"
    start, end = "", ""
    parallel = False
    arguments_key = "parameters"

    def system_text(self, tools: Sequence[Tool]) -> str:
        listing = "\n\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function "
            "call with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n" + listing
        )

    def result_text(self, content: str, name: str) -> str:
        return content

    def stream(self, tools: Sequence[Tool]) -> Reader:
        return HeldStream(self, tools)

    def parse(self, text: str, tools: Sequence[Tool]) -> tuple[str, list[ToolCall]]:
        """A reply that is a call, after <|python_tag|> or alone. Calls after the first
        (";"-separated, as the model may write them) are left out: its template could not
        take them back."""
        body = text.strip().removeprefix("<|python_tag|>").lstrip()
        try:
            _, n = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return text, []
        call = self._call(body[:n], tools)
        rest = body[n:].strip()
        if call is None or (rest and not rest.startswith(";")):
            return text, []
        return "", [call]


class HeldStream:
    """A format read only whole: everything is held until ``end``, then handed on."""

    def __init__(self, fmt: Format, tools: Sequence[Tool]) -> None:
        self.fmt, self.tools = fmt, tools
        self._held: list[str] = []

    cut = False

    def feed(self, text: str) -> list[Event]:
        self._held.append(text)
        return []

    def end(self) -> list[Event]:
        text, calls = self.fmt.parse("".join(self._held), self.tools)
        out: list[Event] = [Said(text)] if text else []
        for k, c in enumerate(calls):
            out += [CallOpened(k, c.id, c.name), Args(k, c.arguments), CallClosed(k, c)]
        return out
