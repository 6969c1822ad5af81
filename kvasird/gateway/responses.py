"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

request   model, instructions, input (a string, or items: messages with input_text /
          output_text parts, function_call and function_call_output items), tools
          (flat: {type: "function", name, description, parameters}), tool_choice,
          parallel_tool_calls, text.format (text | json_object | json_schema),
          temperature, top_p, max_output_tokens (clamped to what the context leaves),
          reasoning.effort, stream, previous_response_id, store; reasoning items sent
          back in ``input`` are dropped (templates leave past reasoning out)
prompt    the previous response's conversation (when named), then the instructions as
          the system message (instructions are not carried over, as OpenAI documents),
          then the input, through the model's chat template with the tools
reply     a response object: output items (a reasoning item with the model's
          reasoning when reasoning.effort was asked of a model that reasons, a message
          with output_text, function_call items for the calls the model made), usage,
          status "completed" or "incomplete" (max_output_tokens)
stream    response.created, response.in_progress, then per output item
          output_item.added, (content_part.added, output_text.delta..., output_text.done,
          content_part.done | function_call_arguments.delta, .done | reasoning_text.delta,
          .done), output_item.done,
          then response.completed; every event numbered (sequence_number). With tools,
          text is sent as soon as it cannot be the start of a call, and each call as it
          is written (its arguments as partial JSON); a call cut off by the token limit
          ends "incomplete".
store     responses kept STORE_S (at most STORE_MAX, the oldest dropped first) in this
          gateway's memory, for previous_response_id and GET: a chain of turns without
          resending them, within a bounded time; DELETE forgets one at once
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any
from weakref import WeakKeyDictionary

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvasird.gateway.body import Fields, objects, read_json, text
from kvasird.gateway.errors import ApiError, BadRequest, NotFound
from kvasird.gateway.generation import Choice, Done, Piece
from kvasird.gateway.openai import content_text, response_format, unset_as
from kvasird.gateway.response import GenerationResponse, sse
from kvasird.gateway.service import Gateway, Job
from kvasird.gateway.tools import (
    ToolUse,
    asks_parallel,
    choose,
    parse_tool,
    thinking_in,
    tool_items,
)
from kvasird.inference.api import Sampling, SamplingParams
from kvasird.text.chat import Message
from kvasird.text.toolcalls.calls import ToolCall
from kvasird.text.toolcalls.events import (
    Args,
    Broken,
    CallClosed,
    CallOpened,
    Event,
    Said,
    Thought,
)

STORE_S = 3600.0
STORE_MAX = 256


class Store:
    """Stored responses: id -> (time, the conversation so far, the response object)."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, tuple[float, list[Message], dict[str, Any]]] = OrderedDict()

    def put(self, rid: str, conversation: list[Message], body: dict[str, Any]) -> None:
        self._items[rid] = (time.monotonic(), conversation, body)
        self._items.move_to_end(rid)
        while len(self._items) > STORE_MAX:
            self._items.popitem(last=False)

    def get(self, rid: str, where: str) -> tuple[list[Message], dict[str, Any]]:
        hit = self._items.get(rid)
        if hit is None or time.monotonic() - hit[0] > STORE_S:
            self._items.pop(rid, None)
            raise NotFound(
                f"response {rid!r} is not stored here (responses are kept "
                f"{STORE_S / 60:g} minutes, {STORE_MAX} at most): send the whole "
                "conversation as `input` instead",
                where,
                "response_not_found",
            )
        return hit[1], hit[2]

    def delete(self, rid: str, where: str) -> None:
        self.get(rid, where)
        del self._items[rid]


_stores: WeakKeyDictionary[Gateway, Store] = WeakKeyDictionary()


def store_of(gw: Gateway) -> Store:
    if gw not in _stores:
        _stores[gw] = Store()
    return _stores[gw]


async def create(gw: Gateway, request: Request) -> GenerationResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    name = f.string("model")
    info, tok, template = gw.resolve(name)
    previous = f.string("previous_response_id", None)
    history = list(store_of(gw).get(previous, "previous_response_id")[0]) if previous else []
    conversation = [*history, *input_items(f)]
    if not conversation:
        raise BadRequest("`input` is empty: there is nothing to answer", "input")
    system = [Message("system", f.string("instructions"))] if f.has("instructions") else []
    use = tool_use(f, template)
    reasoning = gw.reasoning(
        template, f.obj("reasoning").string("effort", None), "reasoning.effort"
    )
    prompt = gw.check_prompt(
        info,
        gw.chat_prompt(template, tok, [*system, *conversation], "input", use.tools, reasoning),
        "input",
    )
    fmt = f.obj("text").obj("format")
    grammar = use.grammar or response_format(_as_response_format(fmt))
    if use.grammar and fmt.string("type", "text") != "text":
        raise BadRequest(
            "`text.format` and a `tool_choice` that forces a call cannot both "
            "hold the reply: drop one",
            "text.format",
        )
    params = SamplingParams(**unset_as(f, info.sampling, 2), grammar=grammar)
    limit = gw.output_limit(info, prompt, f.integer("max_output_tokens", None), "max_output_tokens")
    job = gw.job(
        info,
        tok,
        name,
        prompt,
        Sampling(params, limit.granted),
        stream=f.boolean("stream", False),
        limit=limit,
        reasoning=reasoning,
    )
    echo = {
        "instructions": f.value.get("instructions"),
        "previous_response_id": previous,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_output_tokens": limit.granted,
        "reasoning": f.obj("reasoning").value or None,
        "tools": f.value.get("tools") or [],
        "tool_choice": f.value.get("tool_choice", "auto"),
        "parallel_tool_calls": f.boolean("parallel_tool_calls", True),
        "text": {"format": fmt.value or {"type": "text"}},
        "metadata": f.obj("metadata").value,
    }
    renderer = ResponsesRenderer(
        job,
        thinking_in(use, tok, prompt),
        echo,
        conversation,
        store_of(gw) if f.boolean("store", True) else None,
    )
    return GenerationResponse(gw, job, renderer)


async def retrieve(gw: Gateway, request: Request) -> JSONResponse:
    return JSONResponse(store_of(gw).get(request.path_params["response_id"], "response_id")[1])


async def delete(gw: Gateway, request: Request) -> JSONResponse:
    """Forget a stored response, answered as OpenAI's deleted object (404 when it is not
    stored here)."""
    rid = request.path_params["response_id"]
    store_of(gw).delete(rid, "response_id")
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


def _as_response_format(fmt: Fields) -> Fields:
    """text.format as Chat Completions' response_format (json_schema's fields sit flat)."""
    if fmt.string("type", "text") != "json_schema":
        return fmt
    return Fields(
        {
            "type": "json_schema",
            "json_schema": {"name": fmt.string("name", ""), "schema": fmt.obj("schema").value},
        },
        fmt.path,
    )


def input_items(f: Fields) -> list[Message]:
    raw = f.value.get("input")
    if isinstance(raw, str):
        return [Message("user", str(text(raw, "input")))]
    if not isinstance(raw, list):
        raise BadRequest("`input` must be a string or an array of input items", "input")
    out: list[Message] = []
    for item in objects(raw, "input"):
        kind = item.string("type", "message")
        if kind == "message":
            role = item.string("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(
                    f"`{item.where('role')}` must be user, assistant, system or "
                    f"developer, got {role!r}",
                    item.where("role"),
                )
            out.append(
                Message(
                    "system" if role == "developer" else role,
                    content_text(
                        item.value.get("content"),
                        item.where("content"),
                        ("input_text", "output_text", "text"),
                    ),
                )
            )
        elif kind == "function_call":
            call = ToolCall(
                item.string("call_id"), item.string("name"), item.string("arguments", "{}")
            )
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                last = out.pop()
                out.append(Message("assistant", last.content, (*last.tool_calls, call)))
            else:
                out.append(Message("assistant", "", (call,)))
        elif kind == "reasoning":
            continue
        elif kind == "function_call_output":
            output = item.value.get("output")
            out.append(
                Message(
                    "tool",
                    output if isinstance(output, str) else json.dumps(output),
                    tool_call_id=item.string("call_id"),
                )
            )
        else:
            raise BadRequest(
                f"`{item.where('type')}` is {kind!r}: this gateway takes message, "
                "function_call, function_call_output and reasoning items",
                item.where("type"),
            )
    return out


def tool_use(f: Fields, template: Any) -> ToolUse:
    """The Responses API's tools (flat function objects) and tool_choice."""
    if not f.value.get("tools"):
        return ToolUse(format=template.tool_format)
    tools = []
    for t in tool_items(f, "tools"):
        if t.string("type") != "function":
            raise BadRequest(
                f"`{t.where('type')}` is {t.string('type')!r}: only function tools are supported",
                t.where("type"),
            )
        tools.append(parse_tool(t, "name", "description", "parameters"))
    choice = f.value.get("tool_choice", "auto")
    parallel = asks_parallel(f)
    if choice in ("none", "auto", "required"):
        return choose(tools, template, choice, None, parallel, "tool_choice")
    return choose(
        tools, template, "named", f.obj("tool_choice").string("name"), parallel, "tool_choice"
    )


class ResponsesRenderer:
    ping = b": ping\n\n"

    def __init__(
        self,
        job: Job,
        use: ToolUse,
        echo: dict[str, Any],
        conversation: list[Message],
        store: Store | None,
    ) -> None:
        self.job, self.use, self.echo = job, use, echo
        self.conversation, self.store = conversation, store
        self.id = f"resp_{job.request.request_id}"
        self.msg_id = f"msg_{job.request.request_id}"
        self.created = time.time()
        self._seq = 0
        self._reader = use.reader() if use.reads else None
        self._items: list[dict[str, Any]] = []
        """The output items so far, in order (the open one is still being written)."""
        self._open: dict[str, Any] | None = None
        self._messages = 0

    # --- the response object ----------------------------------------------------------

    def response(
        self, status: str, output: list[dict[str, Any]], done: Done | None
    ) -> dict[str, Any]:
        usage = (
            None
            if done is None
            else {
                "input_tokens": done.prompt_tokens,
                "output_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "input_tokens_details": {
                    "cached_tokens": done.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens_details": {"reasoning_tokens": 0},
                **(self.job.limit.usage() if self.job.limit else {}),
            }
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.job.model_name,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "usage": usage,
            "truncation": "disabled",
            "store": self.store is not None,
            **self.echo,
        }

    def _finish(self, done: Done) -> dict[str, Any]:
        if not self._items:
            self._apply([Said("")])
        self._close("incomplete" if self._reader is not None and self._reader.cut else "completed")
        said = "".join(
            i["content"][0]["text"] for i in self._items if i["type"] == "message" and i["content"]
        )
        calls = tuple(
            ToolCall(i["call_id"], i["name"], i["arguments"])
            for i in self._items
            if i["type"] == "function_call" and i["status"] == "completed"
        )
        status = "incomplete" if done.reason == "length" else "completed"
        # a call the token limit cut off (its arguments no JSON) is streamed, never returned
        output = [
            i for i in self._items if i["type"] != "function_call" or i["status"] == "completed"
        ]
        body = self.response(status, output, done)
        if self.store is not None:
            self.store.put(self.id, [*self.conversation, Message("assistant", said, calls)], body)
        return body

    # --- output items, built from the reply's events in order --------------------------

    def _events_of(self, text_: str, end: bool = False) -> list[Event]:
        if self._reader is None:
            return [Said(text_)] if text_ else []
        return [*self._reader.feed(text_), *(self._reader.end() if end else [])]

    def _apply(self, events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            i = len(self._items) - 1
            if isinstance(e, Said):
                if self._open is None or self._open["type"] != "message":
                    out += self._close("completed")
                    ident = self.msg_id + (f"_{self._messages}" if self._messages else "")
                    self._messages += 1
                    self._open = {
                        "type": "message",
                        "id": ident,
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [],
                    }
                    self._items.append(self._open)
                    i += 1
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    out += [
                        self._event("response.output_item.added", output_index=i, item=self._open),
                        self._event(
                            "response.content_part.added",
                            item_id=ident,
                            output_index=i,
                            content_index=0,
                            part=part,
                        ),
                    ]
                    self._open["content"].append(part)
                if e.text:
                    self._open["content"][0]["text"] += e.text
                    out.append(
                        self._event(
                            "response.output_text.delta",
                            item_id=self._open["id"],
                            output_index=i,
                            content_index=0,
                            delta=e.text,
                            logprobs=[],
                        )
                    )
            elif isinstance(e, Thought) and e.text and self.job.reasoning.shown:
                if self._open is None or self._open["type"] != "reasoning":
                    out += self._close("completed")
                    self._open = {
                        "type": "reasoning",
                        "id": f"rs_{self.job.request.request_id}_{len(self._items)}",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}],
                        "status": "in_progress",
                    }
                    self._items.append(self._open)
                    i += 1
                    out.append(
                        self._event("response.output_item.added", output_index=i, item=self._open)
                    )
                self._open["content"][0]["text"] += e.text
                out.append(
                    self._event(
                        "response.reasoning_text.delta",
                        item_id=self._open["id"],
                        output_index=i,
                        content_index=0,
                        delta=e.text,
                    )
                )
            elif isinstance(e, CallOpened):
                out += self._close("completed")
                self._open = {
                    "type": "function_call",
                    "id": "fc_" + e.id.removeprefix("call_"),
                    "call_id": e.id,
                    "name": e.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._items.append(self._open)
                out.append(
                    self._event("response.output_item.added", output_index=i + 1, item=self._open)
                )
            elif isinstance(e, Args) and self._open is not None:
                self._open["arguments"] += e.text
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=i,
                        delta=e.text,
                    )
                )
            elif isinstance(e, CallClosed | Broken):
                out += self._close("completed" if isinstance(e, CallClosed) else "incomplete")
        return out

    def _close(self, status: str) -> list[bytes]:
        item, i = self._open, len(self._items) - 1
        if item is None:
            return []
        self._open = None
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    part=part,
                ),
            ]
        elif item["type"] == "reasoning":
            out = [
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=item["content"][0]["text"],
                )
            ]
        else:
            out = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        return [*out, self._event("response.output_item.done", output_index=i, item=item)]

    # --- Renderer -----------------------------------------------------------------------

    def error(self, err: ApiError) -> dict[str, Any]:
        return err.openai()

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        (only,) = choices
        self._apply(self._events_of(only.text, end=True))
        return self._finish(only.done)

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        return sse({"type": kind, "sequence_number": self._seq - 1, **fields}, kind)

    def stream_start(self) -> list[bytes]:
        start = self.response("in_progress", [], None)
        return [
            self._event("response.created", response=start),
            self._event("response.in_progress", response=start),
        ]

    def stream_piece(self, piece: Piece) -> list[bytes]:
        return self._apply(self._events_of(piece.text))

    def stream_end(self, dones: list[Done]) -> list[bytes]:
        (done,) = dones
        out = self._apply(self._events_of("", end=True))
        if not self._items:
            out += self._apply([Said("")])
        out += self._close(
            "incomplete" if self._reader is not None and self._reader.cut else "completed"
        )
        body = self._finish(done)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [*out, self._event(kind, response=body)]

    def stream_error(self, err: ApiError) -> list[bytes]:
        body = self.response("failed", [], None)
        code, message = err.code or "server_error", err.message
        body["error"] = {"code": code, "message": message}
        return [
            self._event("error", code=code, message=message, param=err.param),
            self._event("response.failed", response=body),
        ]
