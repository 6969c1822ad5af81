"""Anthropic's API: /v1/messages and /v1/messages/count_tokens.

The stream is the event sequence the official SDK accumulates: message_start,
content_block_start, ping, content_block_delta…, content_block_stop, message_delta
(stop_reason, stop_sequence, usage), message_stop; an ``error`` event when the
generation fails after it started. Keep-alives are ``ping`` events.
"""

from __future__ import annotations

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
from kvasird.inference.api import Sampling
from kvasird.inference.chat import Message

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


async def messages(gw: Gateway, request: Request) -> GenerationResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    name = f.string("model")
    info, tok, template = gw.resolve(name)
    prompt = gw.check_prompt(info, gw.chat_prompt(template, tok, conversation(f), "messages"),
                             "messages")
    for name_ in ("tools", "tool_choice"):
        if f.value.get(name_):
            raise BadRequest(f"`{name_}` is not supported by this gateway", name_)
    if f.obj("thinking").string("type", "disabled") != "disabled":
        raise BadRequest("extended thinking is not supported by this gateway", "thinking")
    params = SamplingParams(temperature=f.number("temperature", 1.0, 0, 1), top_p=top_p(f),
                            top_k=f.integer("top_k", 0, 0, 1 << 20))
    sampling = Sampling(params, gw.max_tokens(f.integer("max_tokens"), "max_tokens"))
    job = gw.job(info, tok, name, prompt, sampling, stops=stops(f, "stop_sequences"),
                 stream=f.boolean("stream", False))
    return GenerationResponse(gw, job, MessagesRenderer(job))


async def count_tokens(gw: Gateway, request: Request) -> JSONResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    _, tok, template = gw.resolve(f.string("model"))
    prompt = gw.chat_prompt(template, tok, conversation(f), "messages")
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
        out.append(Message(role, content_text(m.value.get("content"), m.where("content"))))
    if out[-1].role == "assistant":
        out[-1] = Message("assistant", out[-1].content.rstrip())
    return out


class MessagesRenderer:
    ping = sse({"type": "ping"}, "ping")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.id = f"msg_{job.request.request_id}"

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
        return self.message([{"type": "text", "text": only.text}], only.done,
                            only.done.completion_tokens)

    def stream_start(self) -> list[bytes]:
        return [sse({"type": "message_start", "message": self.message([], None, 0)},
                    "message_start"),
                sse({"type": "content_block_start", "index": 0,
                     "content_block": {"type": "text", "text": ""}}, "content_block_start"),
                self.ping]

    def stream_piece(self, piece: Piece) -> list[bytes]:
        if not piece.text:
            return []
        return [sse({"type": "content_block_delta", "index": 0,
                     "delta": {"type": "text_delta", "text": piece.text}}, "content_block_delta")]

    def stream_end(self, dones: list[Done]) -> list[bytes]:
        (done,) = dones
        return [sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                sse({"type": "message_delta",
                     "delta": {"stop_reason": STOP_REASON[done.reason],
                               "stop_sequence": done.stop_sequence},
                     "usage": {"output_tokens": done.completion_tokens}}, "message_delta"),
                sse({"type": "message_stop"}, "message_stop")]
