"""Tool calls: tools into the prompt, the model's calls out of its text, in its family's format.

    Tool        a function a caller offers: name, description, JSON-schema parameters
    ToolCall    one call the model made: id, name, arguments (JSON text, as OpenAI sends it)
    Format      how a model family writes calls, picked from its chat template (``format_of``):
                  hermes  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one
                          block per call (Qwen 2.5/3, Hermes, SmolLM3; the default)
                  qwen_xml <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>
                          ...</function>\n</tool_call>, values as raw text (Qwen 3.5/3.6,
                          Qwen3-Coder)
                  llama3  {"name": ..., "parameters": {...}}, after <|python_tag|> or alone,
                          one call per reply (Llama 3.1 to 3.3)
                  mistral [TOOL_CALLS]NAME[ARGS]{...} per call (Mistral Small 3.2, Devstral);
                          mistral_list: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                          (Mistral Nemo); the markers are special tokens, kept like harmony's
                  harmony <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
                          {...}<|call|>, one call per generation (<|call|> ends it), among
                          messages on channels: analysis (reasoning), final (the answer),
                          commentary (gpt-oss). Every reply is read by it, with tools or
                          without, and its markers (special tokens) are kept in the decoded
                          text for it (``Format.markers``)

    prompt      the template gets ``tools`` as OpenAI's [{"type": "function", "function": ...}]
                and messages with ``tool_calls`` and role "tool"; a template that never reads
                them (the bundled ChatML one) gets the tools in a system message and the
                calls and results as text, in the format's own words (``Format.plain``)
    grammar     tool_choice "required" (Anthropic "any") or one named function: the output
                is held to calls of the allowed tools whose arguments validate against their
                schemas (``Format.grammar``, an llguidance Lark grammar with %json parts)
    parse       ``Format.parse(text)`` -> the text outside calls and the calls, for "auto"
                (the model may call or answer) and the constrained choices alike
    stream      ``Format.stream(tools)`` reads a reply as it is generated and hands on
                events: Said (text that can no longer be the start of a call), Opened (a
                call's name, as soon as it is written), Args (its arguments' JSON text as it
                comes), Closed (the call whole; its arguments are exactly the Args joined)
                and Thought (reasoning, never content: harmony's analysis channel).
                ``read`` (and ``parse``) is a stream fed the whole text, so a streamed reply
                and a whole one hold the same text and calls. A call cut off by the token
                limit is never Closed: a stream has sent its start, a whole reply leaves it
                out. Hermes, Qwen's XML, Mistral and harmony are read incrementally;
                Llama 3 (no start marker, and a reply is either a call or all text) is
                held to the end.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llguidance import LLMatcher

from kvasird.inference.grammar import JSON_OPTIONS, check

MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON Schema of the arguments object."""

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description":
                                                 self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments object as JSON text."""

    @staticmethod
    def new(name: str, arguments: Any) -> ToolCall:
        return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


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

    def system_text(self, tools: Sequence[Tool]) -> str:
        """The tools described for a template that does not read ``tools`` itself."""
        listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user "
                "query.\n\nYou are provided with function signatures within <tools></tools> "
                f"XML tags:\n<tools>\n{listing}\n</tools>\n\nFor each function call, return a "
                "json object with function name and arguments within <tool_call></tool_call> "
                "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")

    def call_text(self, call: ToolCall) -> str:
        body = {"name": call.name, self.arguments_key: _loads(call.arguments)}
        return f"{self.start}{json.dumps(body, ensure_ascii=False)}{self.end}"

    def result_text(self, content: str, name: str) -> str:
        """A tool's result, ``name`` the tool's ("" when unknown)."""
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, tools: Sequence[Tool], parallel: bool = True) -> str:
        """Output that is one call (or, with ``parallel``, several) of ``tools``, each with
        arguments that validate against that tool's schema."""
        one = " | ".join(f"c{i}" for i in range(len(tools)))
        more = f" ({_literal(self.separator)} call)*" if parallel and self.parallel else ""
        rules = [f"start: {_literal(self.opening)} call{more} {_literal(self.closing)}",
                 f"call: {self._call_rule(one)}"]
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
        return f"%json {json.dumps(self._schema(tool))}"

    def _schema(self, tool: Tool) -> dict[str, Any]:
        return {"type": "object", "x-guidance": JSON_OPTIONS,
                "properties": {"name": {"const": tool.name},
                               self.arguments_key: tool.parameters or {"type": "object"}},
                "required": ["name", self.arguments_key], "additionalProperties": False}

    def stream(self, tools: Sequence[Tool]) -> Reader:
        """A reader of one reply, fed as it is generated."""
        return CallStream(self, tools)

    def parse(self, text: str, tools: Sequence[Tool]) -> tuple[str, list[ToolCall]]:
        """The text outside calls, and the complete calls of known tools (in order). A block
        that is not a call of a tool offered stays text."""
        reply = self.read(text, tools)
        return reply.text, list(reply.calls)

    def read(self, text: str, tools: Sequence[Tool]) -> Reply:
        """A whole reply: ``parse``'s text and calls, and its reasoning."""
        reader = self.stream(tools)
        events = [*reader.feed(text), *reader.end()]
        calls = tuple(e.call for e in events if isinstance(e, Closed))
        said = "".join(e.text for e in events if isinstance(e, Said | Broken))
        return Reply(said.strip() if calls else said, calls,
                     "".join(e.text for e in events if isinstance(e, Thought)))

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
            args = _loads(args)
        return ToolCall.new(value["name"], args if isinstance(args, dict) else {})

    def plain(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages with tool calls and results as text, for a template that knows neither."""
        out: list[dict[str, Any]] = []
        names: dict[str, str] = {}
        """Call id -> tool name, for results that do not name their tool."""
        for m in messages:
            if m["role"] == "tool":
                text = self.result_text(m["content"], m.get("name") or
                                        names.get(m.get("tool_call_id", ""), ""))
                if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                else:
                    out.append({"role": "user", "content": text, "tool_results": True})
            elif m.get("tool_calls"):
                names.update((c.id, c.name) for c in m["tool_calls"])
                calls = "\n".join(self.call_text(c) for c in m["tool_calls"])
                out.append({"role": m["role"],
                            "content": (m["content"] + "\n" if m["content"] else "") + calls})
            else:
                out.append(m)
        return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


class Llama3(Format):
    """Llama 3.1+: a bare JSON object with "name" and "parameters". One call per reply: the
    templates of Llama 3.1 to 3.3 refuse an assistant message with more than one."""

    name = "llama3"
    start, end = "", ""
    parallel = False
    arguments_key = "parameters"

    def system_text(self, tools: Sequence[Tool]) -> str:
        listing = "\n\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function "
                "call with its proper arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of '
                "argument name and its value}. Do not use variables.\n\n" + listing)

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


class Harmony(Format):
    """gpt-oss: a reply is messages on channels; a call is a message to ``functions.NAME``
    whose body is the arguments object (``HarmonyStream``)."""

    name = "harmony"
    parallel = False
    markers = frozenset({"<|start|>", "<|channel|>", "<|message|>", "<|constrain|>",
                         "<|end|>", "<|call|>", "<|return|>"})
    framed = True

    def system_text(self, tools: Sequence[Tool]) -> str:
        listing = "\n\n".join(_typescript(t) for t in tools)
        return ("# Tools\n\n## functions\n\nnamespace functions {\n\n"
                f"{listing}\n\n}} // namespace functions")

    def call_text(self, call: ToolCall) -> str:
        return (f"<|channel|>commentary to=functions.{call.name} <|constrain|>json<|message|>"
                f"{call.arguments}<|call|>")

    def result_text(self, content: str, name: str) -> str:
        return (f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"
                f"{content}<|end|>")

    def _call_rule(self, tools: str) -> str:
        """The markers are special tokens: the grammar names them as such (llguidance's
        ``<|...|>``), so only those tokens match, never their text spelled out. The
        generation's end (``<|call|>``) is the end-of-generation token a complete grammar
        allows."""
        return f'<|channel|> "commentary to=functions." ({tools})'

    def _tool_rule(self, tool: Tool) -> str:
        schema = {**(tool.parameters or {"type": "object"}), "x-guidance": JSON_OPTIONS}
        return (f'{json.dumps(tool.name + " ")} <|constrain|> "json" <|message|> '
                f"%json {json.dumps(schema)}")

    def stream(self, tools: Sequence[Tool]) -> Reader:
        return HarmonyStream(tools)


def _typescript(tool: Tool) -> str:
    """A tool as harmony declares one, in TypeScript: its description, then its type."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    fields = "".join((f"// {p['description']}\n" if p.get("description") else "")
                     + f"{k}{'' if k in required else '?'}: {_ts_type(p)},\n"
                     for k, p in props.items())
    signature = f"(_: {{\n{fields}}}) => any" if props else "() => any"
    return f"// {tool.description}\ntype {tool.name} = {signature};"


def _ts_type(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if schema.get("type") == "array":
        return f"{_ts_type(schema.get('items') or {})}[]"
    return {"string": "string", "integer": "number", "number": "number",
            "boolean": "boolean", "object": "object"}.get(str(schema.get("type")), "any")


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
        return ("# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                f"{listing}\n</tools>\n\nTo call a function, reply with only this, one "
                "parameter block per argument:\n\n<tool_call>\n<function=function_name>\n"
                "<parameter=parameter_name>\nvalue\n</parameter>\n</function>\n</tool_call>")

    def call_text(self, call: ToolCall) -> str:
        args = _loads(call.arguments)
        params = "".join(f"<parameter={k}>\n{_xml_text(v)}\n</parameter>\n"
                         for k, v in (args.items() if isinstance(args, dict) else ()))
        return f"{self.start}<function={call.name}>\n{params}</function>{self.end}"

    def _tool_rule(self, tool: Tool) -> str:
        """The parameters in the schema's order, the required ones present, the others
        optional, no others: the XML has no way to say "these keys in any order", so the
        order is fixed (a model writes them in the order it was shown)."""
        parts = [json.dumps(f"<function={tool.name}>\n")]
        required = set(tool.parameters.get("required") or ())
        for key, schema in _properties(tool).items():
            value = (_text_terminal(schema) if _is_text(schema) else
                     f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})} "
                     + json.dumps("\n</parameter>"))
            param = " ".join([json.dumps(f"<parameter={key}>\n"), value, json.dumps("\n")])
            parts.append(param if key in required else f"({param})?")
        return " ".join([*parts, '"</function>"'])

    def _terminals(self, tools: Sequence[Tool]) -> list[str]:
        return sorted({_text_lexeme(schema) for t in tools for schema in
                       _properties(t).values() if _is_text(schema)
                       and "enum" not in schema and "const" not in schema})

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
    return (f"{name}: /(?s:.{bounds})\\n<\\/parameter>/ & "
            "~/(?s:.*)<\\/parameter>(?s:.+)/")


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
        how = ('[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
               if self.listed else "[TOOL_CALLS]<function-name>[ARGS]<args-json-object>")
        return f"# Tools\n\n{listing}\n\nTo call a function, write: {how}"

    def call_text(self, call: ToolCall) -> str:
        if self.listed:
            body = {"name": call.name, "arguments": _loads(call.arguments)}
            return f"[TOOL_CALLS][{json.dumps(body, ensure_ascii=False)}]"
        return f"[TOOL_CALLS]{call.name}[ARGS]{call.arguments}"

    def _tool_rule(self, tool: Tool) -> str:
        if self.listed:
            return super()._tool_rule(tool)
        schema = {**(tool.parameters or {"type": "object"}), "x-guidance": JSON_OPTIONS}
        return f'{json.dumps(tool.name)} "[ARGS]" %json {json.dumps(schema)}'

    def stream(self, tools: Sequence[Tool]) -> Reader:
        return MistralStream(self, tools)


FORMATS: dict[str, Format] = {"hermes": Format(), "llama3": Llama3(), "harmony": Harmony(),
                            "qwen_xml": QwenXML(), "mistral": Mistral(listed=False),
                            "mistral_list": Mistral(listed=True)}


@dataclass(frozen=True)
class Reply:
    """A whole reply, read (``Format.read``)."""

    text: str
    """The text outside calls: the content."""
    calls: tuple[ToolCall, ...] = ()
    """Its complete calls, in order."""
    reasoning: str = ""
    """What the model reasoned before answering (Thought): never content."""


# --- reading a reply as it is generated --------------------------------------------------

@dataclass(frozen=True)
class Said:
    """Text outside calls."""

    text: str


@dataclass(frozen=True)
class Opened:
    """A call began; ``index`` counts the reply's calls from 0."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Args:
    """More of call ``index``'s arguments, as JSON text."""

    index: int
    text: str


@dataclass(frozen=True)
class Closed:
    """Call ``index`` is complete."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class Broken:
    """Call ``index`` ended before its arguments did: it was no call. ``text`` is the block
    as written (a whole reply keeps it as text; a stream has sent its start already)."""

    index: int
    text: str


@dataclass(frozen=True)
class Thought:
    """The model's reasoning (harmony's analysis channel): not content."""

    text: str


Event = Said | Opened | Args | Closed | Broken | Thought


class Reader(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def end(self) -> list[Event]:
        """The events left once the reply has ended."""
        ...

    @property
    def cut(self) -> bool:
        """Whether the reply ended inside a call."""
        ...


class CallStream:
    """Hermes-style calls, ``start`` JSON ``end``, read incrementally.

    Text is handed on except a tail that could begin ``start`` and trailing whitespace
    (dropped if a call follows). In a call, once ``{"name": "<a tool>", "<arguments key>":``
    has been written the call is Opened and its arguments object is passed on character by
    character, its end found by counting braces outside strings. A call written otherwise
    (keys in another order, arguments as a string) is handed on whole at ``end``; a block
    naming no tool offered stays text."""

    _START, _END = "<tool_call>", "</tool_call>"

    def __init__(self, fmt: Format, tools: Sequence[Tool]) -> None:
        self.fmt, self.tools = fmt, tools
        self._names = {t.name for t in tools}
        self._head = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"'
                                + re.escape(fmt.arguments_key) + r'"\s*:\s*')
        self._text = ""
        """Held text outside calls."""
        self._space = ""
        """Held trailing whitespace."""
        self._body: str | None = None
        """The current call's text after ``start`` (None outside calls)."""
        self._open: Opened | None = None
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
                self._space, self._body = "", self._text[i + len(self._START):]
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

    def _say(self, text: str, out: list[Event]) -> None:
        body = text.rstrip()
        if body:
            out.append(Said(self._space + body))
            self._space = text[len(body):]
        else:
            self._space += text

    # --- a call ---

    def _read_call(self, out: list[Event]) -> bool:
        """Reads the current call; True when it ended (the rest is text again)."""
        body = self._body or ""
        if self._open is None:
            m = self._head.match(body)
            if m and len(body) > m.end() and m.group(1) in self._names and body[m.end()] == "{":
                self._open = Opened(self._calls, new_call_id(), m.group(1))
                out.append(self._open)
                self._args_at = self._scan = m.end()
        if self._open is not None and not self._args_end:
            broken = self._scan_args(body, out)
            if broken >= 0:
                out.append(Broken(self._open.index, self._START + body[:broken] + self._END))
                self._calls += 1
                return self._next(body[broken + len(self._END):])
            if not self._args_end:
                return False
        j = body.find(self._END, self._args_end)
        if j < 0:
            return False
        whole, rest = body[:j], body[j + len(self._END):]
        call = self.fmt._call(whole.strip(), self.tools)
        if self._open is not None:
            raw = body[self._args_at:self._args_end]
            out.append(Closed(self._open.index, ToolCall(self._open.id, self._open.name, raw)))
            self._calls += 1
        elif call is not None:
            out += [Opened(self._calls, call.id, call.name), Args(self._calls, call.arguments),
                    Closed(self._calls, call)]
            self._calls += 1
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
            if c == "<" and not self._in_string and \
                    self._END.startswith(body[i:i + len(self._END)]):
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
            out.append(Args(self._open.index, body[start:self._scan]))
        return broken


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
            out += [Opened(k, c.id, c.name), Args(k, c.arguments), Closed(k, c)]
        return out


class HarmonyStream:
    """gpt-oss's replies, read incrementally. A reply is messages: a header (its channel,
    maybe ``to=RECIPIENT``, maybe a content type such as ``<|constrain|>json``), then
    ``<|message|>``, then the body, to ``<|end|>`` (more messages may follow, each from
    ``<|start|>``), ``<|call|>`` or ``<|return|>``. The reply's first header begins at
    ``<|channel|>``: the prompt ends with ``<|start|>assistant``. The markers are special
    tokens, so nothing else reads as one: text is handed on as it comes, but for a tail
    that may begin a marker.

    An analysis body is Thought, a final or commentary one Said. A message to
    ``functions.NAME`` of a tool offered is a call: Opened once its header is read, its
    body passed on as Args, Closed at its end marker or at the reply's end (``<|call|>``
    ends the generation, so the decoded text lacks it) when the body is a JSON object,
    Broken at an end marker when it is not, and cut, never Closed, when the reply ends
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
        self._open: Opened | None = None
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
            marks = ((self._MESSAGE, *self._ENDS, "<|start|>") if self._header is not None
                     else (*self._ENDS, *self._HEADS))
            found = [(i, m) for m in marks if (i := self._held.find(m)) >= 0]
            if not found:
                keep = len(self._held) - _marker_tail(self._held, marks)
                self._body(self._held[:keep], out)
                self._held = self._held[keep:]
                return out
            i, mark = min(found)
            self._body(self._held[:i], out)
            self._held = self._held[i + len(mark):]
            self._marker(mark, out)

    def end(self) -> list[Event]:
        out: list[Event] = []
        self._body(self._held, out)
        self._held = ""
        if self._open is not None and _is_object(self._args):
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
            if self._open is not None and _is_object(self._args):
                self._close(out)
            elif self._open is not None:
                out.append(Broken(self._open.index,
                                  self._written + (mark if mark in self._ENDS else "")))
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
            self._open = Opened(self._calls, new_call_id(), name)
            self._written, self._args = header, ""
            out.append(self._open)
        elif to:
            self._verbatim = True
            out.append(Said(header))
        else:
            self._kind = Thought if channel and channel.group(1) == "analysis" else Said

    def _close(self, out: list[Event]) -> None:
        assert self._open is not None
        out.append(Closed(self._open.index, ToolCall(self._open.id, self._open.name,
                                                     self._args)))
        self._calls, self._open = self._calls + 1, None


class XMLCallStream(CallStream):
    """Qwen's XML calls, read incrementally: Opened once ``<function=NAME>`` names a tool
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
        """"head" (before the function tag), "params", "done" (the call is Closed, the
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
            rest = body[self._at:]
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
                self._open = Opened(self._calls, new_call_id(), name)
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
                self._at = at + (len(self._FUNCTION_END) if tail.startswith(self._FUNCTION_END)
                                 else 0)
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
                out += [Opened(self._calls, call.id, call.name),
                        Args(self._calls, call.arguments), Closed(self._calls, call)]
                self._calls += 1
            else:
                self._say(self._START + whole + self._END, out)
        return self._next(body[j + len(self._END):])

    def _arg(self, key: str, text: str, out: list[Event]) -> None:
        """A parameter read: its key and value as the next piece of the arguments' JSON (a
        key written twice keeps its first value)."""
        assert self._open is not None
        if key in self._keys:
            return
        value = _xml_value(text, self._schemas[self._open.name].get(key) or {})
        piece = (", " if self._pieces else "{") + \
            f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._keys.add(key)
        self._pieces.append(piece)
        out.append(Args(self._open.index, piece))

    def _close(self, out: list[Event]) -> None:
        assert self._open is not None
        piece = "}" if self._pieces else "{}"
        arguments = "".join(self._pieces) + piece
        out += [Args(self._open.index, piece),
                Closed(self._open.index, ToolCall(self._open.id, self._open.name, arguments))]
        self._calls += 1
        self._open, self._pieces, self._keys = None, [], set()


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
                    out.append(Args(self._open.index, body[self._sent:upto]))
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
            self._say(self._START + body[:i + len(self._ARGS)], out)
            return self._next(body[i + len(self._ARGS):])
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
        tail = body[self._at:].lstrip(" \n,")
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
            out += [Opened(self._calls, call.id, call.name), Args(self._calls, call.arguments),
                    Closed(self._calls, call)]
            self._calls += 1
        else:
            self._say(body[at:end], out)
        self._at = end
        return None

    def _opened(self, name: str, args_at: int, out: list[Event]) -> None:
        self._open = Opened(self._calls, new_call_id(), name)
        out.append(self._open)
        self._args_at = self._sent = args_at

    def _end_call(self, body: str, end: int, out: list[Event]) -> bool:
        """The open call's arguments end at ``end``: Closed (or Broken); whether the block
        goes on (a list's next item) rather than ending."""
        assert self._open is not None
        args = body[self._args_at:end]
        if _is_object(args):
            out.append(Closed(self._open.index, ToolCall(self._open.id, self._open.name,
                                                         args)))
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


def _tag(text: str, opening: str) -> str | None:
    """The name in ``text``'s leading ``<opening>NAME>`` tag; "" while ``text`` may still
    become one, None when it cannot."""
    if len(text) < len(opening):
        return "" if opening.startswith(text) else None
    if not text.startswith(opening):
        return None
    m = re.match(r"[^>\n]*", text[len(opening):])
    assert m is not None
    end = len(opening) + m.end()
    if end == len(text):
        return ""
    return m.group() if text[end] == ">" and m.group() else None


def _marker_tail(text: str, markers: Sequence[str]) -> int:
    """The length of the tail of ``text`` that may begin one of ``markers`` (each has one
    "<", at its start: only the last "<" can begin one)."""
    i = text.rfind("<")
    return len(text) - i if i >= 0 and any(m.startswith(text[i:]) for m in markers) else 0


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def format_of(template: str | None) -> Format:
    """The tool format a chat template's text points to (Hermes unless it is another's)."""
    source = template or ""
    if "<|start|>" in source and "<|channel|>" in source:
        return FORMATS["harmony"]
    if "<function=" in source and "<parameter=" in source:
        return FORMATS["qwen_xml"]
    if "[TOOL_CALLS]" in source:
        return FORMATS["mistral" if "[ARGS]" in source else "mistral_list"]
    if "<|python_tag|>" in source or "<|eom_id|>" in source or (
            "<|start_header_id|>" in source and "ipython" in source):
        return FORMATS["llama3"]  # 3.2 has neither tag, but its tool role is "ipython"
    return FORMATS["hermes"]


def reads_tools(template: str | None) -> bool:
    """Whether a template renders ``tools`` and tool messages itself."""
    return bool(template) and "tools" in template and "tool_calls" in template  # type: ignore[operator]


def _literal(text: str) -> str:
    """``text`` as a Lark string, or nothing for none."""
    return json.dumps(text) if text else ""


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {}
