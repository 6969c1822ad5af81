"""Hermes' format, the base every family's derives from, and its stream (CallStream), the
base of the streams that read calls between a start and an end marker:

    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>

one block per call (Qwen 2.5/3, Hermes, SmolLM3; the default).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from typing import Any

from llguidance import LLMatcher

from kvasird.text.grammar import check, json_part
from kvasird.text.toolcalls.calls import (
    MAX_PARALLEL_CALLS,
    Tool,
    ToolCall,
    new_call_id,
    parse_arguments,
)
from kvasird.text.toolcalls.events import (
    Args,
    Broken,
    CallClosed,
    CallOpened,
    Event,
    Reader,
    Reply,
    Said,
    Thought,
)
from kvasird.text.toolcalls.think import ThinkStream


class Format:
    """A family's tool-call syntax (the base is Hermes')."""

    name = "hermes"
    start, end = "<tool_call>\n", "\n</tool_call>"
    separator = "\n"
    """Between parallel calls."""
    parallel = True
    """A reply may hold several calls (False: one call per reply)."""
    opening, closing = "", ""
    """Around all of a reply's calls (Mistral's list)."""
    arguments_key = "arguments"
    markers: frozenset[str] = frozenset()
    """Special tokens a reply is read by: decoding keeps their text (the others a model
    writes are dropped)."""
    framed = False
    """Every reply is written in the format's frame (harmony's channels), so it is read
    by the format even when no tools are offered."""
    reasons = False
    """The model reasons before it answers, on a channel of its own that is read as
    Thought (harmony's analysis channel), with an effort its template takes as
    ``reasoning_effort``."""
    thinks = False
    """A reply may open with reasoning between think tags (kvasird.text.toolcalls.think),
    read as Thought; the template switches the mode with ``enable_thinking``."""

    def thinking(self) -> Format:
        """This format for a template with a think-tag reasoning mode."""
        fmt = copy.copy(self)
        fmt.thinks = True
        return fmt

    def system_text(self, tools: Sequence[Tool]) -> str:
        """The tools described for a template that does not read ``tools`` itself."""
        listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user "
            "query.\n\nYou are provided with function signatures within <tools></tools> "
            f"XML tags:\n<tools>\n{listing}\n</tools>\n\nFor each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>"
        )

    def call_text(self, call: ToolCall) -> str:
        body = {"name": call.name, self.arguments_key: parse_arguments(call.arguments)}
        return f"{self.start}{json.dumps(body, ensure_ascii=False)}{self.end}"

    def result_text(self, content: str, name: str) -> str:
        """A tool's result, ``name`` the tool's ("" when unknown)."""
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        """Output that is one call of ``tools`` (with ``parallel``, where the format allows
        several, up to MAX_PARALLEL_CALLS), each with arguments that validate against that
        tool's schema. Once the last call it allows is written the grammar is complete:
        only the end of generation may follow, so the reply ends as its calls."""
        one = " | ".join(f"c{i}" for i in range(len(tools)))
        more = ""
        if parallel and self.parallel:
            more = f" ({_literal(self.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}"
        rules = [
            f"start: {_literal(self.opening)} call{more} {_literal(self.closing)}",
            f"call: {self._call_rule(one)}",
        ]
        rules += [f"c{i}: {self._tool_rule(t)}" for i, t in enumerate(tools)]
        rules += self._terminals(tools)
        grammar = LLMatcher.grammar_from_lark("\n".join(rules))
        check(grammar, "tools")
        return grammar

    def _call_rule(self, tools: str) -> str:
        """One call in the grammar; ``tools`` is the rule that picks the tool."""
        return f"{_literal(self.start)} ({tools}) {_literal(self.end)}"

    def _terminals(self, tools: Sequence[Tool]) -> list[str]:
        """The grammar's lexer rules, if its tool rules need any."""
        return []

    def _tool_rule(self, tool: Tool) -> str:
        return json_part(self._schema(tool))

    def _schema(self, tool: Tool) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                self.arguments_key: tool.parameters or {"type": "object"},
            },
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }

    def stream(self, tools: Sequence[Tool]) -> Reader:
        """A reader of one reply's text and calls, fed as it is generated."""
        return CallStream(self, tools)

    def reader(self, tools: Sequence[Tool], opened: bool = False) -> Reader:
        """A reader of one reply, fed as it is generated: ``stream``'s, behind a think-block
        reader where the model thinks in tags (``opened``: the prompt opened the block)."""
        stream = self.stream(tools)
        return ThinkStream(stream, opened) if self.thinks else stream

    def parse(self, text: str, tools: Sequence[Tool]) -> tuple[str, list[ToolCall]]:
        """The text outside calls, and the complete calls of known tools (in order). A block
        that is not a call of a tool offered stays text."""
        reply = self.read(text, tools)
        return reply.text, list(reply.calls)

    def read(self, text: str, tools: Sequence[Tool], opened: bool = False) -> Reply:
        """A whole reply: ``parse``'s text and calls, and its reasoning."""
        reader = self.reader(tools, opened)
        events = [*reader.feed(text), *reader.end()]
        calls = tuple(e.call for e in events if isinstance(e, CallClosed))
        said = "".join(e.text for e in events if isinstance(e, Said | Broken))
        return Reply(
            said.strip() if calls else said,
            calls,
            "".join(e.text for e in events if isinstance(e, Thought)),
        )

    def _call(self, body: str, tools: Sequence[Tool]) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        names = {t.name for t in tools}
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        args = value.get(self.arguments_key, value.get("arguments", value.get("parameters", {})))
        if isinstance(args, str):
            args = parse_arguments(args)
        return ToolCall.new(value["name"], args if isinstance(args, dict) else {})

    def plain(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages with tool calls and results as text, for a template that knows neither."""
        out: list[dict[str, Any]] = []
        names: dict[str, str] = {}
        """Call id -> tool name, for results that do not name their tool."""
        for m in messages:
            if m["role"] == "tool":
                text = self.result_text(
                    m["content"], m.get("name") or names.get(m.get("tool_call_id", ""), "")
                )
                if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                else:
                    out.append({"role": "user", "content": text, "tool_results": True})
            elif m.get("tool_calls"):
                names.update((c.id, c.name) for c in m["tool_calls"])
                calls = "\n".join(self.call_text(c) for c in m["tool_calls"])
                out.append(
                    {
                        "role": m["role"],
                        "content": (m["content"] + "\n" if m["content"] else "") + calls,
                    }
                )
            else:
                out.append(m)
        return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


class CallStream:
    """Hermes-style calls, ``start`` JSON ``end``, read incrementally.

    Text is handed on except a tail that could begin ``start`` and trailing whitespace
    (dropped if a call follows). In a call, once ``{"name": "<a tool>", "<arguments key>":``
    has been written the call is CallOpened and its arguments object is passed on character by
    character, its end found by counting braces outside strings. A call written otherwise
    (keys in another order, arguments as a string) is handed on whole at ``end``; a block
    naming no tool offered stays text."""

    _START, _END = "<tool_call>", "</tool_call>"

    def __init__(self, fmt: Format, tools: Sequence[Tool]) -> None:
        self.fmt, self.tools = fmt, tools
        self._names = {t.name for t in tools}
        self._head = re.compile(
            r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"' + re.escape(fmt.arguments_key) + r'"\s*:\s*'
        )
        self._text = ""
        """Held text outside calls."""
        self._space = ""
        """Held trailing whitespace."""
        self._body: str | None = None
        """The current call's text after ``start`` (None outside calls)."""
        self._open: CallOpened | None = None
        self._args_at = 0
        """Where the open call's arguments begin in ``_body``."""
        self._scan = 0
        """How far the arguments have been scanned (and sent)."""
        self._depth, self._in_string, self._escape = 0, False, False
        self._args_end = 0
        """Where the arguments end in ``_body`` (0 until they do)."""
        self._calls = 0

    @property
    def cut(self) -> bool:
        return self._body is not None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._body is None:
            self._text += text
        else:
            self._body += text
        while True:
            if self._body is None:
                i = self._text.find(self._START)
                if i < 0:
                    keep = len(self._text) - self._prefix(self._text)
                    self._say(self._text[:keep], out)
                    self._text = self._text[keep:]
                    return out
                self._say(self._text[:i], out)
                self._space, self._body = "", self._text[i + len(self._START) :]
                self._text = ""
            if not self._read_call(out):
                return out

    def end(self) -> list[Event]:
        out: list[Event] = []
        if self._body is None:
            self._say(self._text, out)
            if self._space and not self._calls:
                out.append(Said(self._space))
            self._text = self._space = ""
        return out

    # --- text ---

    def _prefix(self, text: str) -> int:
        """The length of the longest tail of ``text`` that begins ``start``."""
        for k in range(min(len(self._START) - 1, len(text)), 0, -1):
            if self._START.startswith(text[-k:]):
                return k
        return 0

    def _whole(self, call: ToolCall, out: list[Event]) -> None:
        """A call read whole at once: opened, its arguments, closed."""
        out += [
            CallOpened(self._calls, call.id, call.name),
            Args(self._calls, call.arguments),
            CallClosed(self._calls, call),
        ]
        self._calls += 1

    def _say(self, text: str, out: list[Event]) -> None:
        body = text.rstrip()
        if body:
            out.append(Said(self._space + body))
            self._space = text[len(body) :]
        else:
            self._space += text

    # --- a call ---

    def _read_call(self, out: list[Event]) -> bool:
        """Reads the current call; True when it ended (the rest is text again)."""
        body = self._body or ""
        if self._open is None:
            m = self._head.match(body)
            if m and len(body) > m.end() and m.group(1) in self._names and body[m.end()] == "{":
                self._open = CallOpened(self._calls, new_call_id(), m.group(1))
                out.append(self._open)
                self._args_at = self._scan = m.end()
        if self._open is not None and not self._args_end:
            broken = self._scan_args(body, out)
            if broken >= 0:
                out.append(Broken(self._open.index, self._START + body[:broken] + self._END))
                self._calls += 1
                return self._next(body[broken + len(self._END) :])
            if not self._args_end:
                return False
        j = body.find(self._END, self._args_end)
        if j < 0:
            return False
        whole, rest = body[:j], body[j + len(self._END) :]
        call = self.fmt._call(whole.strip(), self.tools)
        if self._open is not None:
            raw = body[self._args_at : self._args_end]
            out.append(CallClosed(self._open.index, ToolCall(self._open.id, self._open.name, raw)))
            self._calls += 1
        elif call is not None:
            self._whole(call, out)
        else:
            self._say(self._START + whole + self._END, out)
        return self._next(rest)

    def _next(self, rest: str) -> bool:
        """The call is over; ``rest`` is text again."""
        self._body, self._open, self._args_end, self._depth = None, None, 0, 0
        self._in_string = self._escape = False
        self._text = rest
        return True

    def _scan_args(self, body: str, out: list[Event]) -> int:
        """Passes on the arguments written since the last scan; where ``end`` was written
        inside them (outside strings), or -1."""
        start, broken = self._scan, -1
        for i in range(start, len(body)):
            c = body[i]
            if (
                c == "<"
                and not self._in_string
                and self._END.startswith(body[i : i + len(self._END)])
            ):
                if body.startswith(self._END, i):
                    broken = i
                self._scan = i  # an end marker, or the start of one: not arguments
                break
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._args_end = i + 1
                    break
        else:
            self._scan = len(body)
        if self._args_end:
            self._scan = self._args_end
        if self._scan > start and self._open is not None:
            out.append(Args(self._open.index, body[start : self._scan]))
        return broken


def _literal(text: str) -> str:
    """``text`` as a Lark string, or nothing for none."""
    return json.dumps(text) if text else ""
