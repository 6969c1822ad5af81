"""Tools in the two APIs: what a request offers and forces, and the calls in a reply.

request    OpenAI     tools [{type: "function", function: {name, description, parameters}}],
                      tool_choice "none" | "auto" | "required" | {type, function: {name}},
                      parallel_tool_calls
           Anthropic  tools [{name, description, input_schema}],
                      tool_choice {type: "auto" | "any" | "tool" (name) | "none",
                                   disable_parallel_tool_use}
           -> ToolUse: the tools the prompt offers, and the grammar that forces a call
              ("" under "auto": the model may answer in text, its calls are parsed out).
              A forced reply is one call, unless the client asked for parallel calls in
              so many words (``parallel_tool_calls: true``, ``disable_parallel_tool_use:
              false``), and then at most MAX_PARALLEL_CALLS: the grammar then allows only
              the end, so the reply ends as its calls (finish reason "tool_calls", stop
              reason "tool_use"), never at the token limit with another call opened
messages   OpenAI assistant ``tool_calls`` and role "tool"; Anthropic ``tool_use`` and
           ``tool_result`` blocks -> chat Messages the template renders back
reply      the model's text parsed by its family's format (kvasird.text.toolcalls) ->
           OpenAI ``message.tool_calls`` / Anthropic ``tool_use`` blocks, with finish
           reason "tool_calls" / stop reason "tool_use"; streamed as it is generated
           (``ToolUse.reader``): a call's name as soon as it is written, its arguments
           as partial JSON. A format that frames every reply (harmony), or a model that
           thinks in tags (Qwen3), reads it with tools or without: its reasoning is
           OpenAI's ``reasoning_content``, and Anthropic's thinking blocks and the
           Responses API's reasoning item when reasoning was asked for
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvasird.gateway.body import Fields, objects
from kvasird.gateway.errors import BadRequest
from kvasird.text.chat import ChatTemplate, Message
from kvasird.text.grammar import GrammarError, for_json_schema
from kvasird.text.tokenizer import Tokenizer
from kvasird.text.toolcalls.calls import MAX_TOOLS, Tool, ToolCall
from kvasird.text.toolcalls.events import Reader, Reply
from kvasird.text.toolcalls.hermes import Format
from kvasird.text.toolcalls.think import opens_thinking

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
THINK_TAIL = 8
"""Tokens at a prompt's end read for a think block it opens."""


@dataclass(frozen=True)
class ToolUse:
    """What a request asked of tools."""

    tools: tuple[Tool, ...] = ()
    """Offered to the model in the prompt (none under tool_choice "none")."""
    grammar: str = ""
    """Forces the reply to be calls ("" = the model chooses)."""
    format: Format | None = None
    """How the model writes its replies and calls (None: as plain text)."""
    opened: bool = False
    """The prompt opened a think block: the reply begins with reasoning (``thinking_in``)."""

    @property
    def reads(self) -> bool:
        """Whether replies go through the format: tools are offered, it frames every reply
        (harmony's channels), or a reply may open with a think block."""
        return self.format is not None and (
            bool(self.tools) or self.format.framed or self.format.thinks
        )

    def read(self, text: str) -> Reply:
        """The reply's text outside calls, its complete calls and its reasoning."""
        if self.format is None or not self.reads:
            return Reply(text)
        return self.format.read(text, self.tools, self.opened)

    def reader(self) -> Reader:
        """Reads one reply as it streams (kvasird.text.toolcalls.hermes.Format.reader)."""
        assert self.format is not None and self.reads
        return self.format.reader(self.tools, self.opened)


def thinking_in(use: ToolUse, tokenizer: Tokenizer, prompt: Sequence[int]) -> ToolUse:
    """``use`` for a reply to ``prompt``: one that starts inside a think block where the
    template opened it in the prompt (Qwen3-Thinking, DeepSeek-R1)."""
    if use.format is None or not use.format.thinks:
        return use
    tail = tokenizer.decode(list(prompt[-THINK_TAIL:]))
    return dataclasses.replace(use, opened=opens_thinking(tail))


def finish_with_calls(reason: str, called: bool) -> bool:
    """Whether a reply ends as tool calls: it made one and the model stopped by itself (a
    reply cut off by the token limit says so, whatever calls it holds)."""
    return called and reason != "length"


def openai_tool_use(f: Fields, template: ChatTemplate) -> ToolUse:
    raw = f.value.get("tools")
    if not raw:
        if f.value.get("tool_choice") not in (None, "none", "auto"):
            raise BadRequest(
                "`tool_choice` asks for a tool call but `tools` is empty", "tool_choice"
            )
        return ToolUse(format=template.tool_format)
    tools = []
    for t in tool_items(f, "tools"):
        if t.string("type", "function") != "function":
            raise BadRequest(f'`{t.where("type")}` must be "function"', t.where("type"))
        fn = t.obj("function")
        tools.append(parse_tool(fn, "name", "description", "parameters"))
    choice = f.value.get("tool_choice", "auto")
    parallel = asks_parallel(f)
    if choice in ("none", "auto", "required"):
        return choose(tools, template, choice, None, parallel, "tool_choice")
    c = f.obj("tool_choice")
    return choose(
        tools, template, "named", c.obj("function").string("name"), parallel, "tool_choice"
    )


def anthropic_tool_use(f: Fields, template: ChatTemplate) -> ToolUse:
    if not f.value.get("tools"):
        return ToolUse(format=template.tool_format)
    tools = [parse_tool(t, "name", "description", "input_schema") for t in tool_items(f, "tools")]
    c = f.obj("tool_choice")
    kind = c.string("type", "auto")
    modes = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
    if kind not in modes:
        raise BadRequest(f"`{c.where('type')}` must be one of {', '.join(modes)}", c.where("type"))
    parallel = not c.boolean("disable_parallel_tool_use", True)  # allowed only when said
    return choose(
        tools,
        template,
        modes[kind],
        c.string("name") if kind == "tool" else None,
        parallel,
        "tool_choice",
    )


def asks_parallel(f: Fields) -> bool:
    """Whether an OpenAI request asked for parallel calls itself. OpenAI's default (absent)
    allows them, but a client that forces a call and leaves it out means one call: agents
    do (openai-agents sends no ``parallel_tool_calls`` unless told), and a small model
    allowed more keeps opening calls until the token limit."""
    return f.boolean("parallel_tool_calls", False)


def tool_items(f: Fields, name: str) -> list[Fields]:
    raw = f.array(name)
    if len(raw) > MAX_TOOLS:
        raise BadRequest(f"`{name}` holds {len(raw)} tools, more than {MAX_TOOLS}", name)
    return objects(raw, name)


def parse_tool(t: Fields, name_key: str, description_key: str, schema_key: str) -> Tool:
    name = t.string(name_key)
    if not NAME.match(name):
        raise BadRequest(
            f"`{t.where(name_key)}` must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
            t.where(name_key),
        )
    schema = t.obj(schema_key).value or {"type": "object", "properties": {}}
    try:
        for_json_schema(schema, t.where(schema_key))
    except GrammarError as exc:
        raise BadRequest(str(exc), t.where(schema_key)) from None
    return Tool(name, t.string(description_key, ""), schema)


def choose(
    tools: list[Tool],
    template: ChatTemplate,
    mode: str,
    name: str | None,
    parallel: bool,
    where: str,
) -> ToolUse:
    """What ``mode`` ("none", "auto", "required", "named" with ``name``) asks of ``tools``."""
    fmt = template.tool_format
    if mode == "none":
        return ToolUse(format=fmt)
    try:
        if mode == "auto":
            return ToolUse(tuple(tools), "", fmt)
        if mode == "named":
            chosen = [t for t in tools if t.name == name]
            if not chosen:
                raise BadRequest(f"`{where}` names {name!r}, which is not among `tools`", where)
            return ToolUse(tuple(tools), fmt.grammar(chosen, parallel=False), fmt)
        return ToolUse(tuple(tools), fmt.grammar(tools, parallel), fmt)
    except GrammarError as exc:
        raise BadRequest(f"`tools`: {exc}", "tools") from None


# --- messages ------------------------------------------------------------------------


def openai_calls(m: Fields) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``."""
    out = []
    for c in objects(m.array("tool_calls"), m.where("tool_calls")):
        fn = c.obj("function")
        arguments = fn.string("arguments", "{}")
        try:
            json.loads(arguments)
        except ValueError:
            raise BadRequest(
                f"`{fn.where('arguments')}` must be a JSON object as text", fn.where("arguments")
            ) from None
        out.append(ToolCall(c.string("id", ""), fn.string("name"), arguments))
    return tuple(out)


def anthropic_blocks(role: str, content: Any, where: str) -> list[Message]:
    """An Anthropic message whose content holds tool_use or tool_result blocks: its text and
    calls (assistant), or its results, one tool message each, then any text (user)."""
    text, calls, results = [], [], []
    for block in objects(content, where):
        kind = block.string("type")
        if kind == "text":
            text.append(block.string("text"))
        elif kind == "tool_use" and role == "assistant":
            calls.append(
                ToolCall(
                    block.string("id", ""),
                    block.string("name"),
                    json.dumps(block.obj("input").value, ensure_ascii=False),
                )
            )
        elif kind == "tool_result" and role == "user":
            body = block.value.get("content", "")
            if isinstance(body, list):
                body = "".join(
                    p.string("text")
                    for p in objects(body, block.where("content"))
                    if p.string("type") == "text"
                )
            results.append(Message("tool", str(body), tool_call_id=block.string("tool_use_id")))
        else:
            raise BadRequest(
                f"`{block.where('type')}` is {kind!r}: a {role} message holds "
                f"text{' and tool_use' if role == 'assistant' else ' and tool_result'}"
                " blocks",
                block.where("type"),
            )
    if role == "assistant":
        return [Message("assistant", "".join(text), tuple(calls))]
    return [*results, *([Message("user", "".join(text))] if text else [])]


# --- replies -------------------------------------------------------------------------


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def anthropic_tool_blocks(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": _object(c.arguments)}
        for c in calls
    ]


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object ({} for text the model wrote that is none)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
