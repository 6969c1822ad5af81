"""gpt-oss's harmony: a reply is messages on channels, a call a message to a function
(HarmonyStream reads them as they come).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from kvasird.text.grammar import json_part
from kvasird.text.toolcalls.calls import Tool, ToolCall, is_object, new_call_id
from kvasird.text.toolcalls.events import (
    Args,
    Broken,
    CallClosed,
    CallOpened,
    Event,
    Reader,
    Said,
    Thought,
)
from kvasird.text.toolcalls.hermes import Format


class Harmony(Format):
    """gpt-oss: a reply is messages on channels; a call is a message to ``functions.NAME``
    whose body is the arguments object (``HarmonyStream``)."""

    name = "harmony"
    parallel = False
    markers = frozenset(
        {
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|constrain|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
        }
    )
    framed = True
    reasons = True

    def system_text(self, tools: Sequence[Tool]) -> str:
        listing = "\n\n".join(_typescript(t) for t in tools)
        return (
            "# Tools\n\n## functions\n\nnamespace functions {\n\n"
            f"{listing}\n\n}} // namespace functions"
        )

    def call_text(self, call: ToolCall) -> str:
        return (
            f"<|channel|>commentary to=functions.{call.name} <|constrain|>json<|message|>"
            f"{call.arguments}<|call|>"
        )

    def result_text(self, content: str, name: str) -> str:
        return (
            f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"
            f"{content}<|end|>"
        )

    def _call_rule(self, tools: str) -> str:
        """The markers are special tokens: the grammar names them as such (llguidance's
        ``<|...|>``), so only those tokens match, never their text spelled out. The
        generation's end (``<|call|>``) is the end-of-generation token a complete grammar
        allows."""
        return f'<|channel|> "commentary to=functions." ({tools})'

    def _tool_rule(self, tool: Tool) -> str:
        return (
            f'{json.dumps(tool.name + " ")} <|constrain|> "json" <|message|> '
            f"{json_part(tool.parameters or {'type': 'object'})}"
        )

    def stream(self, tools: Sequence[Tool]) -> Reader:
        return HarmonyStream(tools)


def _typescript(tool: Tool) -> str:
    """A tool as harmony declares one, in TypeScript: its description, then its type."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    fields = "".join(
        (f"// {p['description']}\n" if p.get("description") else "")
        + f"{k}{'' if k in required else '?'}: {_ts_type(p)},\n"
        for k, p in props.items()
    )
    signature = f"(_: {{\n{fields}}}) => any" if props else "() => any"
    return f"// {tool.description}\ntype {tool.name} = {signature};"


def _ts_type(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if schema.get("type") == "array":
        return f"{_ts_type(schema.get('items') or {})}[]"
    return {
        "string": "string",
        "integer": "number",
        "number": "number",
        "boolean": "boolean",
        "object": "object",
    }.get(str(schema.get("type")), "any")


class HarmonyStream:
    """gpt-oss's replies, read incrementally. A reply is messages: a header (its channel,
    maybe ``to=RECIPIENT``, maybe a content type such as ``<|constrain|>json``), then
    ``<|message|>``, then the body, to ``<|end|>`` (more messages may follow, each from
    ``<|start|>``), ``<|call|>`` or ``<|return|>``. The reply's first header begins at
    ``<|channel|>``: the prompt ends with ``<|start|>assistant``. The markers are special
    tokens, so nothing else reads as one: text is handed on as it comes, but for a tail
    that may begin a marker.

    An analysis body is Thought, a final or commentary one Said. A message to
    ``functions.NAME`` of a tool offered is a call: CallOpened once its header is read, its
    body passed on as Args, CallClosed at its end marker or at the reply's end (``<|call|>``
    ends the generation, so the decoded text lacks it) when the body is a JSON object,
    Broken at an end marker when it is not, and cut, never CallClosed, when the reply ends
    before it does. A message to anything else stays text, as written. Text outside
    messages is Said (a reply held to a JSON schema writes no header)."""

    _ENDS = ("<|end|>", "<|call|>", "<|return|>")
    _HEADS = ("<|start|>", "<|channel|>")
    _MESSAGE = "<|message|>"
    _TO = re.compile(r"to=([^\s<]+)")
    _CHANNEL = re.compile(r"<\|channel\|>([^\s<]+)")

    def __init__(self, tools: Sequence[Tool]) -> None:
        self._names = {t.name for t in tools}
        self._held = ""
        """Text not yet handed on: a tail that may begin a marker."""
        self._header: str | None = None
        """The header being read, as written (None outside headers)."""
        self._kind: type[Said] | type[Thought] = Said
        """What the current body's text is, outside calls."""
        self._verbatim = False
        """The current message is to no tool offered: text as written, markers and all."""
        self._open: CallOpened | None = None
        self._written = ""
        """The open call as written: its header, then its body so far."""
        self._args = ""
        """The open call's body: its arguments."""
        self._calls = 0

    @property
    def cut(self) -> bool:
        return self._open is not None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._held += text
        while True:
            marks = (
                (self._MESSAGE, *self._ENDS, "<|start|>")
                if self._header is not None
                else (*self._ENDS, *self._HEADS)
            )
            found = [(i, m) for m in marks if (i := self._held.find(m)) >= 0]
            if not found:
                keep = len(self._held) - _marker_tail(self._held, marks)
                self._body(self._held[:keep], out)
                self._held = self._held[keep:]
                return out
            i, mark = min(found)
            self._body(self._held[:i], out)
            self._held = self._held[i + len(mark) :]
            self._marker(mark, out)

    def end(self) -> list[Event]:
        out: list[Event] = []
        self._body(self._held, out)
        self._held = ""
        if self._open is not None and is_object(self._args):
            self._close(out)
        return out

    def _body(self, text: str, out: list[Event]) -> None:
        if self._header is not None:
            self._header += text
        elif text and self._open is not None:
            self._written += text
            self._args += text
            out.append(Args(self._open.index, text))
        elif text:
            out.append(self._kind(text))

    def _marker(self, mark: str, out: list[Event]) -> None:
        if mark == self._MESSAGE:
            self._begin(f"{self._header}{mark}", out)
            return
        if self._header is None:  # a message ends, here or where the next one begins
            if self._open is not None and is_object(self._args):
                self._close(out)
            elif self._open is not None:
                out.append(
                    Broken(self._open.index, self._written + (mark if mark in self._ENDS else ""))
                )
                self._calls, self._open = self._calls + 1, None
            elif self._verbatim and mark in self._ENDS:
                out.append(Said(mark))
            self._kind, self._verbatim = Said, False
        self._header = mark if mark in self._HEADS else None

    def _begin(self, header: str, out: list[Event]) -> None:
        """A message's header has been read: what its body is."""
        self._header = None
        to = self._TO.search(header)
        channel = self._CHANNEL.search(header)
        name = to.group(1).removeprefix("functions.") if to else ""
        if to and to.group(1).startswith("functions.") and name in self._names:
            self._open = CallOpened(self._calls, new_call_id(), name)
            self._written, self._args = header, ""
            out.append(self._open)
        elif to:
            self._verbatim = True
            out.append(Said(header))
        else:
            self._kind = Thought if channel and channel.group(1) == "analysis" else Said

    def _close(self, out: list[Event]) -> None:
        assert self._open is not None
        out.append(
            CallClosed(self._open.index, ToolCall(self._open.id, self._open.name, self._args))
        )
        self._calls, self._open = self._calls + 1, None


def _marker_tail(text: str, markers: Sequence[str]) -> int:
    """The length of the tail of ``text`` that may begin one of ``markers`` (each has one
    "<", at its start: only the last "<" can begin one)."""
    i = text.rfind("<")
    return len(text) - i if i >= 0 and any(m.startswith(text[i:]) for m in markers) else 0
