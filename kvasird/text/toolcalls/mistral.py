"""Mistral's calls after its [TOOL_CALLS] token, one per call or all in one JSON list
(MistralStream reads both as they come).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvasird.text.grammar import json_part
from kvasird.text.toolcalls.calls import Tool, ToolCall, is_object, new_call_id, parse_arguments
from kvasird.text.toolcalls.events import Args, Broken, CallClosed, CallOpened, Event, Reader
from kvasird.text.toolcalls.hermes import CallStream, Format


class Mistral(Format):
    """Mistral's calls, after its ``[TOOL_CALLS]`` token, in one of two forms: each call
    ``[TOOL_CALLS]NAME[ARGS]{...}`` (Mistral Small 3.2, Devstral; ``listed`` False), or
    all of a reply's calls in one JSON list ``[TOOL_CALLS][{"name": ..., "arguments":
    {...}}, ...]`` (Mistral Nemo, 7B v0.3; ``listed``). ``[TOOL_CALLS]``, ``[ARGS]`` and
    ``[CALL_ID]`` are special tokens, kept in the decoded text (``markers``). A grammar
    cannot name them as such (llguidance names a special token ``<NAME>`` and reads
    ``<[...]>`` as token ids), so it spells them out in text: read the same, though a
    model held to it writes them as text tokens, not as the tokens it was trained on."""

    separator = ""
    markers = frozenset({"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"})

    def __init__(self, listed: bool) -> None:
        self.listed = listed
        self.name = "mistral_list" if listed else "mistral"
        if listed:
            self.start, self.end = "", ""
            self.opening, self.closing, self.separator = "[TOOL_CALLS][", "]", ", "
        else:
            self.start, self.end = "[TOOL_CALLS]", ""

    def system_text(self, tools: Sequence[Tool]) -> str:
        listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        how = (
            '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
            if self.listed
            else "[TOOL_CALLS]<function-name>[ARGS]<args-json-object>"
        )
        return f"# Tools\n\n{listing}\n\nTo call a function, write: {how}"

    def call_text(self, call: ToolCall) -> str:
        if self.listed:
            body = {"name": call.name, "arguments": parse_arguments(call.arguments)}
            return f"[TOOL_CALLS][{json.dumps(body, ensure_ascii=False)}]"
        return f"[TOOL_CALLS]{call.name}[ARGS]{call.arguments}"

    def _tool_rule(self, tool: Tool) -> str:
        if self.listed:
            return super()._tool_rule(tool)
        schema = json_part(tool.parameters or {"type": "object"})
        return f'{json.dumps(tool.name)} "[ARGS]" {schema}'

    def stream(self, tools: Sequence[Tool]) -> Reader:
        return MistralStream(self, tools)


class MistralStream(CallStream):
    """Mistral's calls, read incrementally. After ``[TOOL_CALLS]``: ``NAME[ARGS]`` (a
    ``[CALL_ID]ID`` after the name is skipped) opens a call of a tool offered, whose
    arguments object is passed on as it comes and closes it when whole; or, listed, a JSON
    list of ``{"name": ..., "arguments": ...}`` objects, each opened once its name and the
    start of its arguments are read (written otherwise, handed on whole when it ends).
    A call of no tool offered stays text, as written; arguments that are no JSON object
    make the call Broken. The markers are special tokens, so the text after a call is text
    again."""

    _START = "[TOOL_CALLS]"
    _ARGS = "[ARGS]"

    def __init__(self, fmt: Mistral, tools: Sequence[Tool]) -> None:
        super().__init__(fmt, tools)
        self._listed = fmt.listed
        self._reset()

    def _reset(self) -> None:
        self._at = 0
        """How far the body has been read: where the next call (or list item) begins."""
        self._sent = 0
        """How far the open call's arguments have been passed on."""
        self._list = False
        """The list's ``[`` has been read."""
        self._item_at = -1
        """Where the list item of the call just closed begins, until the item ends."""

    def _next(self, rest: str) -> bool:
        self._reset()
        return super()._next(rest)

    def _read_call(self, out: list[Event]) -> bool:
        body = self._body or ""
        while True:
            if self._open is not None:
                no_object = len(body) > self._args_at and body[self._args_at] != "{"
                end = self._args_at if no_object else _json_end(body, self._args_at)
                upto = len(body) if end < 0 else end
                if upto > self._sent:
                    out.append(Args(self._open.index, body[self._sent : upto]))
                    self._sent = upto
                if end < 0:
                    return False
                if not self._end_call(body, end, out):
                    return True
                continue
            step = self._item(body, out) if self._listed else self._named(body, out)
            if step is not None:
                return step

    def _named(self, body: str, out: list[Event]) -> bool | None:
        """``NAME[ARGS]``: None once a call is opened, else whether the block ended."""
        i = body.find(self._ARGS)
        if i < 0:
            return False
        name = body[:i].split("[CALL_ID]")[0].strip()
        if name not in self._names:
            self._say(self._START + body[: i + len(self._ARGS)], out)
            return self._next(body[i + len(self._ARGS) :])
        self._opened(name, i + len(self._ARGS), out)
        return None

    def _item(self, body: str, out: list[Event]) -> bool | None:
        """The list's next item: None once one is read or opened, else whether the list
        (or what stood in its place) ended."""
        if self._item_at >= 0:
            end = _json_end(body, self._item_at)
            if end < 0:
                return False
            self._at, self._item_at = end, -1
        tail = body[self._at :].lstrip(" \n,")
        at = len(body) - len(tail)
        if not tail:
            return False
        if not self._list:
            if tail[0] != "[":
                self._say(self._START, out)
                return self._next(body)
            self._list, self._at = True, at + 1
            return None
        if tail[0] == "]":
            return self._next(tail[1:])
        end = _json_end(body, at)
        m = self._head.match(body, at)
        if m and len(body) > m.end() and body[m.end()] == "{" and m.group(1) in self._names:
            self._item_at = at
            self._opened(m.group(1), m.end(), out)
            return None
        if end < 0:
            return False
        call = self.fmt._call(body[at:end], self.tools)
        if call is not None:
            self._whole(call, out)
        else:
            self._say(body[at:end], out)
        self._at = end
        return None

    def _opened(self, name: str, args_at: int, out: list[Event]) -> None:
        self._open = CallOpened(self._calls, new_call_id(), name)
        out.append(self._open)
        self._args_at = self._sent = args_at

    def _end_call(self, body: str, end: int, out: list[Event]) -> bool:
        """The open call's arguments end at ``end``: CallClosed (or Broken); whether the block
        goes on (a list's next item) rather than ending."""
        assert self._open is not None
        args = body[self._args_at : end]
        if is_object(args):
            out.append(CallClosed(self._open.index, ToolCall(self._open.id, self._open.name, args)))
        else:
            out.append(Broken(self._open.index, self._START + body[:end]))
        self._calls, self._open = self._calls + 1, None
        if not self._listed:
            self._next(body[end:])
            return False
        return True


def _json_end(text: str, start: int) -> int:
    """Just past the JSON object or list that begins at ``text[start]``, by its brackets
    outside strings; -1 while it has not ended (or it does not begin there)."""
    if start >= len(text) or text[start] not in "{[":
        return -1
    depth, in_string, escape = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1
