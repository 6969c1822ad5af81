"""Qwen 3.5/3.6 and Qwen3-Coder: a call is XML, one parameter block per argument
(XMLCallStream reads it a parameter at a time).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from kvasird.text.grammar import json_part
from kvasird.text.toolcalls.calls import Tool, ToolCall, new_call_id, parse_arguments
from kvasird.text.toolcalls.events import Args, Broken, CallClosed, CallOpened, Event, Reader
from kvasird.text.toolcalls.hermes import CallStream, Format


class QwenXML(Format):
    """Qwen 3.5/3.6 and Qwen3-Coder: a call is XML, its arguments one parameter each, the
    value as raw text between newlines (a string as is, any other value as JSON)::

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    The arguments are passed on as a JSON object, a key at a time as its parameter ends
    (``XMLCallStream``). A value is JSON when its parameter's schema takes no strings and
    it parses as JSON, else the string."""

    name = "qwen_xml"

    def system_text(self, tools: Sequence[Tool]) -> str:
        listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
            f"{listing}\n</tools>\n\nTo call a function, reply with only this, one "
            "parameter block per argument:\n\n<tool_call>\n<function=function_name>\n"
            "<parameter=parameter_name>\nvalue\n</parameter>\n</function>\n</tool_call>"
        )

    def call_text(self, call: ToolCall) -> str:
        args = parse_arguments(call.arguments)
        params = "".join(
            f"<parameter={k}>\n{_xml_text(v)}\n</parameter>\n"
            for k, v in (args.items() if isinstance(args, dict) else ())
        )
        return f"{self.start}<function={call.name}>\n{params}</function>{self.end}"

    def _tool_rule(self, tool: Tool) -> str:
        """The parameters in the schema's order, the required ones present, the others
        optional, no others: the XML has no way to say "these keys in any order", so the
        order is fixed (a model writes them in the order it was shown)."""
        parts = [json.dumps(f"<function={tool.name}>\n")]
        required = set(tool.parameters.get("required") or ())
        for key, schema in _properties(tool).items():
            value = (
                _text_terminal(schema)
                if _is_text(schema)
                else f"{json_part(schema)} " + json.dumps("\n</parameter>")
            )
            param = " ".join([json.dumps(f"<parameter={key}>\n"), value, json.dumps("\n")])
            parts.append(param if key in required else f"({param})?")
        return " ".join([*parts, '"</function>"'])

    def _terminals(self, tools: Sequence[Tool]) -> list[str]:
        return sorted(
            {
                _text_lexeme(schema)
                for t in tools
                for schema in _properties(t).values()
                if _is_text(schema) and "enum" not in schema and "const" not in schema
            }
        )

    def stream(self, tools: Sequence[Tool]) -> Reader:
        return XMLCallStream(self, tools)


def _properties(tool: Tool) -> dict[str, Any]:
    """A tool's parameters and their schemas, required ones the schema does not describe
    taking any value."""
    props = dict(tool.parameters.get("properties") or {})
    return props | {k: {} for k in tool.parameters.get("required") or () if k not in props}


def _is_text(schema: dict[str, Any]) -> bool:
    """Whether a parameter takes strings: its value is written as is, not as JSON."""
    if "enum" in schema or "const" in schema:
        return all(isinstance(v, str) for v in schema.get("enum", [schema.get("const")]))
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _xml_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _xml_value(text: str, schema: dict[str, Any]) -> Any:
    """A parameter's value from its text (trimmed of the newline on either side): JSON
    where the schema takes no strings, a string otherwise or where it is no JSON. A
    boolean may be written as a template renders Python's ("True")."""
    text = text.removeprefix("\n").removesuffix("\n")
    if _is_text(schema):
        return text
    if schema.get("type") == "boolean" and text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text_terminal(schema: dict[str, Any]) -> str:
    """A string parameter's value and its closing tag, in the grammar: one of its enum, or
    text without "</parameter>" within its length bounds (its pattern is not held)."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return "(" + " | ".join(json.dumps(f"{v}\n</parameter>") for v in values) + ")"
    return _text_lexeme(schema).split(":")[0]


def _text_lexeme(schema: dict[str, Any]) -> str:
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    bounds = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}"
    name = f"TEXT_{low}_{high if high is not None else 'N'}"
    return f"{name}: /(?s:.{bounds})\\n<\\/parameter>/ & ~/(?s:.*)<\\/parameter>(?s:.+)/"


class XMLCallStream(CallStream):
    """Qwen's XML calls, read incrementally: CallOpened once ``<function=NAME>`` names a tool
    offered, then the arguments object's JSON text a key at a time as each parameter ends,
    closed by ``}`` at ``</function>`` (or at ``</tool_call>`` if that is left out). A
    block naming no tool offered stays text; one whose body is a JSON call (Hermes') is
    read as one; text where a tag belongs makes the call Broken at the block's end. A value
    is raw text to its ``</parameter>``, so the block's end inside a value is the value's."""

    _FUNCTION = "<function="
    _PARAMETER = "<parameter="
    _PARAMETER_END = "</parameter>"
    _FUNCTION_END = "</function>"

    def __init__(self, fmt: Format, tools: Sequence[Tool]) -> None:
        super().__init__(fmt, tools)
        self._schemas = {t.name: _properties(t) for t in tools}
        self._reset()

    def _reset(self) -> None:
        self._at = 0
        """How far the block's body has been read."""
        self._state = "head"
        """"head" (before the function tag), "params", "done" (the call is CallClosed, the
        block's end to come), "broken" or "other" (no call of a tool: read at the end)."""
        self._pieces: list[str] = []
        """The arguments' JSON text so far."""
        self._keys: set[str] = set()

    @property
    def cut(self) -> bool:
        return self._body is not None and self._state != "done"

    def _next(self, rest: str) -> bool:
        self._reset()
        return super()._next(rest)

    def _read_call(self, out: list[Event]) -> bool:
        body = self._body or ""
        while True:
            rest = body[self._at :]
            tail = rest.lstrip()
            at = self._at + len(rest) - len(tail)  # where the next tag begins
            if self._state in ("other", "broken", "done"):
                if self._state == "done" and tail.startswith(self._FUNCTION):
                    self._state, self._at = "head", at  # another call in the same block
                    continue
                return self._block_end(body, out)
            if self._state == "head":
                name = _tag(tail, self._FUNCTION)
                if name == "":
                    return False
                if name is None or name not in self._names:
                    self._state = "other"
                    continue
                self._open = CallOpened(self._calls, new_call_id(), name)
                out.append(self._open)
                self._state, self._at = "params", at + len(self._FUNCTION) + len(name) + 1
                continue
            key = _tag(tail, self._PARAMETER)
            if key:
                start = at + len(self._PARAMETER) + len(key) + 1
                close = body.find(self._PARAMETER_END, start)
                if close < 0:
                    return False
                self._arg(key, body[start:close], out)
                self._at = close + len(self._PARAMETER_END)
            elif tail.startswith(self._FUNCTION_END) or tail.startswith(self._END):
                self._close(out)
                self._state = "done"
                self._at = at + (
                    len(self._FUNCTION_END) if tail.startswith(self._FUNCTION_END) else 0
                )
            elif key == "" or any(t.startswith(tail) for t in (self._FUNCTION_END, self._END)):
                return False
            else:
                self._state = "broken"

    def _block_end(self, body: str, out: list[Event]) -> bool:
        """The block once its call is read (or it is no call), at its end."""
        j = body.find(self._END, self._at)
        if j < 0:
            return False
        whole = body[:j]
        if self._state == "broken" and self._open is not None:
            out.append(Broken(self._open.index, self._START + whole + self._END))
            self._calls += 1
        elif self._state == "other":
            call = self.fmt._call(whole.strip(), self.tools)
            if call is not None:
                self._whole(call, out)
            else:
                self._say(self._START + whole + self._END, out)
        return self._next(body[j + len(self._END) :])

    def _arg(self, key: str, text: str, out: list[Event]) -> None:
        """A parameter read: its key and value as the next piece of the arguments' JSON (a
        key written twice keeps its first value)."""
        assert self._open is not None
        if key in self._keys:
            return
        value = _xml_value(text, self._schemas[self._open.name].get(key) or {})
        piece = (
            ", " if self._pieces else "{"
        ) + f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._keys.add(key)
        self._pieces.append(piece)
        out.append(Args(self._open.index, piece))

    def _close(self, out: list[Event]) -> None:
        assert self._open is not None
        piece = "}" if self._pieces else "{}"
        arguments = "".join(self._pieces) + piece
        out += [
            Args(self._open.index, piece),
            CallClosed(self._open.index, ToolCall(self._open.id, self._open.name, arguments)),
        ]
        self._calls += 1
        self._open, self._pieces, self._keys = None, [], set()


def _tag(text: str, opening: str) -> str | None:
    """The name in ``text``'s leading ``<opening>NAME>`` tag; "" while ``text`` may still
    become one, None when it cannot."""
    if len(text) < len(opening):
        return "" if opening.startswith(text) else None
    if not text.startswith(opening):
        return None
    m = re.match(r"[^>\n]*", text[len(opening) :])
    assert m is not None
    end = len(opening) + m.end()
    if end == len(text):
        return ""
    return m.group() if text[end] == ">" and m.group() else None
