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

from kvasird.gateway.body import Fields, objects, read_json
from kvasird.gateway.errors import ApiError, BadRequest
from kvasird.gateway.generation import Choice, Done, Piece
from kvasird.gateway.openai import content_text, stops, unset_as
from kvasird.gateway.response import GenerationResponse, sse
from kvasird.gateway.service import Gateway, Job
from kvasird.gateway.tools import (
    ToolUse,
    anthropic_blocks,
    anthropic_tool_blocks,
    anthropic_tool_use,
    finish_with_calls,
    thinking_in,
    tool_use_id,
)
from kvasird.inference.api import Sampling, SamplingParams
from kvasird.text.chat import Message
from kvasird.text.toolcalls.events import (
    Args,
    Broken,
    CallClosed,
    CallOpened,
    Event,
    Said,
    Thought,
)

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}
THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})


async def messages(gw: Gateway, request: Request) -> GenerationResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    name = f.string("model")
    info, tok, template = gw.resolve(name)
    use = anthropic_tool_use(f, template)
    reasoning = gw.reasoning(template, thinking_effort(f.obj("thinking")), "thinking", off=True)
    prompt = gw.check_prompt(
        info,
        gw.chat_prompt(template, tok, conversation(f), "messages", use.tools, reasoning),
        "messages",
    )
    params = SamplingParams(**unset_as(f, info.sampling, 1), grammar=use.grammar)
    limit = gw.output_limit(info, prompt, f.integer("max_tokens"), "max_tokens")
    job = gw.job(
        info,
        tok,
        name,
        prompt,
        Sampling(params, limit.granted),
        stops=stops(f, "stop_sequences"),
        stream=f.boolean("stream", False),
        limit=limit,
        reasoning=reasoning,
    )
    return GenerationResponse(gw, job, MessagesRenderer(job, thinking_in(use, tok, prompt)))


async def count_tokens(gw: Gateway, request: Request) -> JSONResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    _, tok, template = gw.resolve(f.string("model"))
    prompt = gw.chat_prompt(
        template, tok, conversation(f), "messages", anthropic_tool_use(f, template).tools
    )
    return JSONResponse({"input_tokens": len(prompt)})


THINKING_BUDGETS = ((4096, "low"), (16384, "medium"))
"""A thinking budget up to each of these (tokens) asks for this reasoning effort; larger
ones for "high"."""


def thinking_effort(thinking: Fields) -> str | None:
    """The reasoning effort Anthropic's ``thinking`` asks for (None: no thinking): enabled
    with a budget (the effort that budget buys), or adaptive (the model's own measure)."""
    kind = thinking.string("type", "disabled")
    if kind == "disabled":
        return None
    if kind == "adaptive":
        return "medium"
    if kind != "enabled":
        raise BadRequest(
            f'`{thinking.where("type")}` must be "enabled", "adaptive" or "disabled", got {kind!r}',
            thinking.where("type"),
        )
    budget = thinking.integer("budget_tokens", THINKING_BUDGETS[0][0], 1)
    return next((effort for most, effort in THINKING_BUDGETS if budget <= most), "high")


def conversation(f: Fields) -> list[Message]:
    """The system prompt (a string or text blocks) and the alternating messages. Thinking
    blocks a client sends back are dropped: chat templates leave past reasoning out (as
    harmony's does), so their signatures need no check."""
    out = []
    if f.has("system"):
        out.append(Message("system", content_text(f.value["system"], "system")))
    raw = f.array("messages")
    if not raw:
        raise BadRequest("`messages` must hold at least one message", "messages")
    for m in objects(raw, "messages"):
        role = m.string("role")
        if role not in ("user", "assistant"):
            raise BadRequest(
                f'`{m.where("role")}` must be "user" or "assistant", got '
                f"{role!r} (the system prompt is the top-level `system`)",
                m.where("role"),
            )
        content = m.value.get("content")
        if isinstance(content, list):
            content = [
                b for b in content if not (isinstance(b, dict) and b.get("type") in THINKING_BLOCKS)
            ]
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result") for b in content
        ):
            out += anthropic_blocks(role, content, m.where("content"))
        else:
            out.append(Message(role, content_text(content, m.where("content"))))
    if out[-1].role == "assistant" and not out[-1].tool_calls:
        out[-1] = Message("assistant", out[-1].content.rstrip())
    return out


class MessagesRenderer:
    """Messages. With tools, the reply is parsed into text blocks and tool_use blocks; a
    stream sends text as soon as it cannot be the start of a call, and each call as a
    tool_use block as it is written, its input as input_json_delta events of partial JSON.
    A stream opens each block at its first content, so no block is empty (a reply with no
    content at all is one empty text block, as the whole body is).

    With ``thinking`` asked of a model that reasons, its reasoning (harmony's analysis
    channel) comes first as a thinking block (streamed as thinking_delta events). Its
    signature is empty: thinking blocks sent back are dropped unread (``conversation``), so
    there is nothing for a signature to protect. Without ``thinking`` it is left out."""

    ping = sse({"type": "ping"}, "ping")

    def __init__(self, job: Job, use: ToolUse | None = None) -> None:
        self.job = job
        self.id = f"msg_{job.request.request_id}"
        self.use = use or ToolUse()
        self._reader = self.use.reader() if self.use.reads else None
        self._block = -1
        """The index of the stream's last content block (-1: none yet)."""
        self._open: str | None = None
        """Its type while it is open (None once stopped)."""
        self._called = False

    def error(self, err: ApiError) -> dict[str, Any]:
        return err.anthropic()

    def stream_error(self, err: ApiError) -> list[bytes]:
        return [sse(err.anthropic(), "error")]

    def message(
        self,
        content: list[dict[str, Any]],
        done: Done | None,
        output_tokens: int,
        called: bool = False,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.job.model_name,
            "content": content,
            "stop_reason": self.stop_reason(done, called) if done else None,
            "stop_sequence": done.stop_sequence if done else None,
            "usage": self.usage(done, output_tokens),
        }

    def usage(self, done: Done | None, output_tokens: int) -> dict[str, int]:
        """Anthropic's input_tokens leave out the prompt tokens read from a cache (here: the
        kept KV a route started from), which it counts as cache_read_input_tokens."""
        cached = done.cached_tokens if done else 0
        return {
            "input_tokens": len(self.job.request.prompt) - cached,
            "cache_read_input_tokens": cached,
            "output_tokens": output_tokens,
            **(self.job.limit.usage() if self.job.limit else {}),
        }

    @staticmethod
    def stop_reason(done: Done, called: bool) -> str:
        return "tool_use" if finish_with_calls(done.reason, called) else STOP_REASON[done.reason]

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        (only,) = choices  # Anthropic's API has no `n`
        reply = self.use.read(only.text)
        calls = list(reply.calls)
        thought = (
            [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}]
            if reply.reasoning and self.job.reasoning.shown
            else []
        )
        blocks = [{"type": "text", "text": reply.text}] if reply.text or not calls else []
        return self.message(
            thought + blocks + anthropic_tool_blocks(calls),
            only.done,
            only.done.completion_tokens,
            bool(calls),
        )

    def stream_start(self) -> list[bytes]:
        return [
            sse({"type": "message_start", "message": self.message([], None, 0)}, "message_start")
        ]

    def stream_piece(self, piece: Piece) -> list[bytes]:
        if self._reader is not None:
            return self._blocks(self._reader.feed(piece.text))
        return self._blocks([Said(piece.text)] if piece.text else [])

    def _blocks(self, events: list[Event]) -> list[bytes]:
        out = []
        for e in events:
            if isinstance(e, Said) and e.text:
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, Thought) and e.text and self.job.reasoning.shown:
                if self._open != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, CallOpened):
                self._called = True
                out += self._start(
                    {"type": "tool_use", "id": tool_use_id(e.id), "name": e.name, "input": {}}
                )
            elif isinstance(e, Args):
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
            elif isinstance(e, CallClosed | Broken):
                out += self._stop()
        return out

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        """Open a content block; the first is followed by a ping, as Anthropic's are."""
        out = self._stop()
        self._block, self._open = self._block + 1, block["type"]
        return [
            *out,
            sse(
                {"type": "content_block_start", "index": self._block, "content_block": block},
                "content_block_start",
            ),
            *([self.ping] if self._block == 0 else []),
        ]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse(
            {"type": "content_block_delta", "index": self._block, "delta": delta},
            "content_block_delta",
        )

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        sign = (
            [self._delta({"type": "signature_delta", "signature": ""})]
            if self._open == "thinking"
            else []
        )
        self._open = None
        return [
            *sign,
            sse({"type": "content_block_stop", "index": self._block}, "content_block_stop"),
        ]

    def stream_end(self, dones: list[Done]) -> list[bytes]:
        (done,) = dones
        out = self._blocks(self._reader.end()) if self._reader is not None else []
        if self._block < 0:  # nothing was said: one empty text block, as in the whole body
            out += self._start({"type": "text", "text": ""})
        return (
            out
            + self._stop()
            + [
                sse(
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": self.stop_reason(done, self._called),
                            "stop_sequence": done.stop_sequence,
                        },
                        "usage": self.usage(done, done.completion_tokens),
                    },
                    "message_delta",
                ),
                sse({"type": "message_stop"}, "message_stop"),
            ]
        )
