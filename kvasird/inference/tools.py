"""Tool calls: tools into the prompt, the model's calls out of its text, in its family's format.

    Tool        a function a caller offers: name, description, JSON-schema parameters
    ToolCall    one call the model made: id, name, arguments (JSON text, as OpenAI sends it)
    Format      how a model family writes calls, picked from its chat template (``format_of``):
                  hermes  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one
                          block per call (Qwen 2.5/3/3.5, Hermes, SmolLM3; the default)
                  llama3  {"name": ..., "parameters": {...}}, after <|python_tag|> or alone
                          (Llama 3.1 and later)

    prompt      the template gets ``tools`` as OpenAI's [{"type": "function", "function": ...}]
                and messages with ``tool_calls`` and role "tool"; a template that never reads
                them (the bundled ChatML one) gets the tools in a system message and the
                calls and results as text, in the format's own words (``Format.plain``)
    grammar     tool_choice "required" (Anthropic "any") or one named function: the output
                is held to calls of the allowed tools whose arguments validate against their
                schemas (``Format.grammar``, an llguidance Lark grammar with %json parts)
    parse       ``Format.parse(text)`` -> the text outside calls and the calls, for "auto"
                (the model may call or answer) and the constrained choices alike

gpt-oss's harmony format is not built yet: its template is refused with tools (the gateway
says so) rather than misread.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from kvasird.inference.grammar import JSON_OPTIONS, GrammarError, check

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
        return ToolCall(f"call_{secrets.token_hex(12)}", name,
                        json.dumps(arguments, ensure_ascii=False))


class Format:
    """A family's tool-call syntax (the base is Hermes')."""

    name = "hermes"
    start, end = "<tool_call>\n", "\n</tool_call>"
    separator = "\n"
    """Between parallel calls."""
    arguments_key = "arguments"

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

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, tools: Sequence[Tool], parallel: bool = True) -> str:
        """Output that is one call (or, with ``parallel``, several) of ``tools``, each with
        arguments that validate against that tool's schema."""
        one = " | ".join(f"c{i}" for i in range(len(tools)))
        more = f" ({json.dumps(self.separator)} call)*" if parallel else ""
        body = f"{json.dumps(self.start)} ({one}) {json.dumps(self.end)}" if self.start else one
        rules = [f"start: call{more}", f"call: {body}"]
        rules += [f"c{i}: %json {json.dumps(self._schema(t))}" for i, t in enumerate(tools)]
        grammar = LLMatcher.grammar_from_lark("\n".join(rules))
        check(grammar, "tools")
        return grammar

    def _schema(self, tool: Tool) -> dict[str, Any]:
        return {"type": "object", "x-guidance": JSON_OPTIONS,
                "properties": {"name": {"const": tool.name},
                               self.arguments_key: tool.parameters or {"type": "object"}},
                "required": ["name", self.arguments_key], "additionalProperties": False}

    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str, tools: Sequence[Tool]) -> tuple[str, list[ToolCall]]:
        """The text outside calls, and the calls of known tools (in order). A block that is
        not a call of a tool offered stays text."""
        calls: list[ToolCall] = []

        def take(m: re.Match[str]) -> str:
            call = self._call(m.group(1), tools)
            if call is None:
                return m.group(0)
            calls.append(call)
            return ""
        rest = self._block.sub(take, text)
        return rest.strip() if calls else text, calls

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
        for m in messages:
            if m["role"] == "tool":
                text = self.result_text(m["content"])
                if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                else:
                    out.append({"role": "user", "content": text, "tool_results": True})
            elif m.get("tool_calls"):
                calls = "\n".join(self.call_text(c) for c in m["tool_calls"])
                out.append({"role": m["role"],
                            "content": (m["content"] + "\n" if m["content"] else "") + calls})
            else:
                out.append(m)
        return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


class Llama3(Format):
    """Llama 3.1+: a bare JSON object with "name" and "parameters"."""

    name = "llama3"
    start, end = "", ""
    separator = "; "
    arguments_key = "parameters"

    def system_text(self, tools: Sequence[Tool]) -> str:
        listing = "\n\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function "
                "call with its proper arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of '
                "argument name and its value}. Do not use variables.\n\n" + listing)

    def result_text(self, content: str) -> str:
        return content

    _object = re.compile(r"(?:<\|python_tag\|>)?\s*(\{.*\})\s*$", re.S)

    def parse(self, text: str, tools: Sequence[Tool]) -> tuple[str, list[ToolCall]]:
        calls = []
        for part in text.split(";"):
            m = self._object.match(part.strip())
            call = self._call(m.group(1), tools) if m else None
            if call is None:
                return text, []
            calls.append(call)
        return "", calls


FORMATS: dict[str, Format] = {"hermes": Format(), "llama3": Llama3()}


def format_of(template: str | None) -> Format:
    """The tool format a chat template's text points to (Hermes unless it is Llama 3's)."""
    source = template or ""
    if "<|start|>" in source and "<|channel|>" in source:
        raise GrammarError("this model writes tool calls in gpt-oss's harmony format, which "
                           "this server does not parse yet: send the request without tools")
    if "<|python_tag|>" in source or "<|eom_id|>" in source:
        return FORMATS["llama3"]
    return FORMATS["hermes"]


def reads_tools(template: str | None) -> bool:
    """Whether a template renders ``tools`` and tool messages itself."""
    return bool(template) and "tools" in template and "tool_calls" in template  # type: ignore[operator]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {}
