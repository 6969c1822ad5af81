"""Anthropic's API: /v1/messages and /v1/messages/count_tokens.

The stream is the event sequence the official SDK accumulates: message_start,
content_block_start, ping, content_block_delta…, content_block_stop, message_delta
(stop_reason, stop_sequence, usage), message_stop; an ``error`` event when the
generation fails after it started. Keep-alives are ``ping`` events.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvasird.compute.sampling import SamplingParams
from kvasird.gateway.body import Fields, objects, read_json
from kvasird.gateway.errors import ApiError, BadRequest
from kvasird.gateway.generation import Choice, Done, Piece
from kvasird.gateway.openai import content_text, stops, top_p
from kvasird.gateway.response import GenerationResponse, sse
from kvasird.gateway.service import Gateway, Job
from kvasird.gateway.tools import (
    ToolUse,
    anthropic_blocks,
    anthropic_tool_blocks,
    anthropic_tool_use,
)
from kvasird.inference.api import Sampling
from kvasird.inference.chat import Message

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


async def messages(gw: Gateway, request: Request) -> GenerationResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    name = f.string("model")
    info, tok, template = gw.resolve(name)
    use = anthropic_tool_use(f, template)
    prompt = gw.check_prompt(info, gw.chat_prompt(template, tok, conversation(f), "messages",
                                                  use.tools), "messages")
    if f.obj("thinking").string("type", "disabled") != "disabled":
        raise BadRequest("extended thinking is not supported by this gateway", "thinking")
    params = SamplingParams(temperature=f.number("temperature", 1.0, 0, 1), top_p=top_p(f),
                            top_k=f.integer("top_k", 0, 0, 1 << 20), grammar=use.grammar)
    sampling = Sampling(params, gw.max_tokens(f.integer("max_tokens"), "max_tokens"))
    job = gw.job(info, tok, name, prompt, sampling, stops=stops(f, "stop_sequences"),
                 stream=f.boolean("stream", False))
    return GenerationResponse(gw, job, MessagesRenderer(job, use))


async def count_tokens(gw: Gateway, request: Request) -> JSONResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    _, tok, template = gw.resolve(f.string("model"))
    prompt = gw.chat_prompt(template, tok, conversation(f), "messages",
                            anthropic_tool_use(f, template).tools)
    return JSONResponse({"input_tokens": len(prompt)})


def conversation(f: Fields) -> list[Message]:
    """The system prompt (a string or text blocks) and the alternating messages."""
    out = []
    if f.has("system"):
        out.append(Message("system", content_text(f.value["system"], "system")))
    raw = f.array("messages")
    if not raw:
        raise BadRequest("`messages` must hold at least one message", "messages")
    for m in objects(raw, "messages"):
        role = m.string("role")
        if role not in ("user", "assistant"):
            raise BadRequest(f"`{m.where('role')}` must be \"user\" or \"assistant\", got "
                             f"{role!r} (the system prompt is the top-level `system`)",
                             m.where("role"))
        content = m.value.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in (
                "tool_use", "tool_result") for b in content):
            out += anthropic_blocks(role, content, m.where("content"))
        else:
            out.append(Message(role, content_text(content, m.where("content"))))
    if out[-1].role == "assistant" and not out[-1].tool_calls:
        out[-1] = Message("assistant", out[-1].content.rstrip())
    return out


class MessagesRenderer:
    """Messages. With tools, the reply is parsed into a text block and tool_use blocks; a
    stream holds the text back until the end, then sends the text block and each call as
    a tool_use block with its input as one input_json_delta."""

    ping = sse({"type": "ping"}, "ping")

    def __init__(self, job: Job, use: ToolUse | None = None) -> None:
        self.job = job
        self.id = f"msg_{job.request.request_id}"
        self.use = use or ToolUse()
        self._held: list[str] = []

    def error(self, err: ApiError) -> dict[str, Any]:
        return err.anthropic()

    def stream_error(self, err: ApiError) -> list[bytes]:
        return [sse(err.anthropic(), "error")]

    def message(self, content: list[dict[str, Any]], done: Done | None,
                output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.job.model_name, "content": content,
                "stop_reason": STOP_REASON[done.reason] if done else None,
                "stop_sequence": done.stop_sequence if done else None,
                "usage": {"input_tokens": len(self.job.request.prompt),
                          "output_tokens": output_tokens}}

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        (only,) = choices  # Anthropic's API has no `n`
        text, calls = self.use.parse(only.text)
        blocks = [{"type": "text", "text": text}] if text or not calls else []
        body = self.message(blocks + anthropic_tool_blocks(calls), only.done,
                            only.done.completion_tokens)
        return {**body, "stop_reason": "tool_use"} if calls else body

    def stream_start(self) -> list[bytes]:
        return [sse({"type": "message_start", "message": self.message([], None, 0)},
                    "message_start"),
                sse({"type": "content_block_start", "index": 0,
                     "content_block": {"type": "text", "text": ""}}, "content_block_start"),
                self.ping]

    def stream_piece(self, piece: Piece) -> list[bytes]:
        if self.use.tools:
            self._held.append(piece.text)
            return []
        if not piece.text:
            return []
        return [sse({"type": "content_block_delta", "index": 0,
                     "delta": {"type": "text_delta", "text": piece.text}}, "content_block_delta")]

    def stream_end(self, dones: list[Done]) -> list[bytes]:
        (done,) = dones
        text, calls = self.use.parse("".join(self._held))
        out = [sse({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": text}}, "content_block_delta")
               ] if text else []
        out.append(sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        for i, block in enumerate(anthropic_tool_blocks(calls), start=1):
            out += [sse({"type": "content_block_start", "index": i,
                         "content_block": {**block, "input": {}}}, "content_block_start"),
                    sse({"type": "content_block_delta", "index": i, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                        "content_block_delta"),
                    sse({"type": "content_block_stop", "index": i}, "content_block_stop")]
        return out + [
                sse({"type": "message_delta",
                     "delta": {"stop_reason": "tool_use" if calls else STOP_REASON[done.reason],
                               "stop_sequence": done.stop_sequence},
                     "usage": {"output_tokens": done.completion_tokens}}, "message_delta"),
                sse({"type": "message_stop"}, "message_stop")]
