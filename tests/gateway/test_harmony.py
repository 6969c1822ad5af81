"""A gpt-oss model's harmony replies through a gateway on loopback: the model's markers reach
the reader, and its calls come out as OpenAI tool_calls and Anthropic tool_use blocks, its
reasoning as OpenAI's reasoning_content and never as content.

The model is a GGUF holding only a tokenizer (the bundled vocabulary with gpt-oss's markers
as control tokens) and a harmony chat template; a scripted Generator writes the reply, as
an engine does: token by token, stopping at the request's stop tokens without handing them on.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from gguf import GGUFValueType, GGUFWriter

from kvasird.config import GatewayConfig
from kvasird.gateway.service import Gateway
from kvasird.inference.api import Finished, GenerationRequest, HopWork, ModelInfo, TokenEvent
from kvasird.model.manifest import Manifest
from kvasird.text.tokenizer import Tokenizer
from kvasird_dev.testmodels import bundled_tokenizer, save
from tests.support import eventually_async

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
           "<|return|>"]
TEMPLATE = (
    "{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: "
    "{{ reasoning_effort }}<|end|>{% endif %}"
    "{% if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}"
    "{{ t.function.name }}\n{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>"
    "json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What time is it in Berlin?"}]
THINK = "<|channel|>analysis<|message|>The user wants the time in Berlin.<|end|>"
CALL = ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>'
        '{"zone": "cet"}<|call|>')


class Scripted:
    """A Generator whose model writes ``script`` (token ids), whatever it is asked."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.script: list[int] = []
        self.prompts: list[tuple[int, ...]] = []
        """The prompts it was asked to continue."""

    def models(self) -> list[ModelInfo]:
        return [self.info]

    async def generate(self, request: GenerationRequest
                       ) -> AsyncIterator[TokenEvent | Finished]:
        produced, reason = 0, "stop"
        self.prompts.append(request.prompt)
        for token in self.script:
            if token in request.stop_tokens:
                break
            if produced == request.sampling.max_tokens:
                reason = "length"
                break
            await trio.lowlevel.checkpoint()
            yield TokenEvent(token)
            produced += 1
        yield Finished(reason, len(request.prompt), produced)

    def work(self, request_id: str) -> tuple[HopWork, ...]:
        return ()


def template_model(path: Path, arch: str, template: str, markers: list[str]) -> Path:
    """A GGUF of the bundled vocabulary (``markers`` added as control tokens) and
    ``template`` as its chat template, for the architecture ``arch``."""
    writer = GGUFWriter(str(path), arch)
    for key, (kind, sub, value) in bundled_tokenizer().items():
        if key == "tokenizer.ggml.tokens":
            value = value + markers
        elif key == "tokenizer.ggml.token_type":
            value = value + [3] * len(markers)
        elif key == "tokenizer.chat_template":
            value = template
        writer.add_key_value(key, value, GGUFValueType(kind), GGUFValueType(sub) if sub else None)
    return save(writer, path)


@contextlib.asynccontextmanager
async def scripted_gateway(path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Scripted]]:
    """A gateway on loopback serving the model at ``path``, whose replies a Scripted writes."""
    manifest = Manifest.from_gguf(path)
    generator = Scripted(ModelInfo(manifest.model_id, f"{path.stem} test", 4096))
    gw = Gateway(GatewayConfig(listen="127.0.0.1:0"), generator=generator,
                 model=lambda: manifest)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(gw.run)
        await eventually_async("the gateway is ready", lambda: gw.ready, timeout=30)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client, generator
        nursery.cancel_scope.cancel()


class Served:
    def __init__(self, client: httpx.AsyncClient, generator: Scripted, tok: Tokenizer) -> None:
        self.client, self.generator, self.tok = client, generator, tok

    def writes(self, text: str) -> None:
        """The model's next replies are ``text`` (markers as their special tokens)."""
        self.generator.script = self.tok.encode(text, special=True)

    async def chat(self, **body: Any) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json={
            "model": self.generator.info.model_id, "messages": ASK, **body})

    async def chat_stream(self, **body: Any) -> list[dict[str, Any]]:
        """The deltas of a streamed chat completion, and its last chunk's choice."""
        r = await self.chat(stream=True, **body)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        return [c["choices"][0] for c in chunks if c["choices"]]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    path = template_model(tmp_path / "harmony.gguf", "gpt-oss", TEMPLATE, MARKERS)
    async with scripted_gateway(path) as (client, generator):
        yield Served(client, generator, Tokenizer.from_gguf(path))


TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Now, in a zone",
                                           "parameters": TIME}}]


async def test_a_harmony_call_is_an_openai_tool_call(served: Served) -> None:
    served.writes(CALL)
    r = await served.chat(tools=TOOLS)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"zone": "cet"}

    deltas = await served.chat_stream(tools=TOOLS)
    parts = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert parts[0]["function"]["name"] == "get_time" and parts[0]["id"].startswith("call_")
    assert "".join(p["function"]["arguments"] for p in parts) == '{"zone": "cet"}'
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_a_harmony_call_is_an_anthropic_tool_use_block(served: Served) -> None:
    served.writes(CALL)
    body = {"model": served.generator.info.model_id, "messages": ASK, "max_tokens": 64,
            "tools": [{"name": "get_time", "input_schema": TIME}]}
    r = await served.client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["stop_reason"] == "tool_use"
    (use,) = message["content"]
    assert use["type"] == "tool_use" and use["name"] == "get_time"
    assert use["input"] == {"zone": "cet"}

    r = await served.client.post("/v1/messages", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    (start,) = [e["content_block"] for e in events if e["type"] == "content_block_start"
                and e["content_block"]["type"] == "tool_use"]
    assert start["name"] == "get_time" and start["id"].startswith("toolu_")
    assert "".join(e["delta"]["partial_json"] for e in events if e["type"] ==
                   "content_block_delta" and e["delta"]["type"] == "input_json_delta") == \
        '{"zone": "cet"}'
    assert not [e for e in events if e["type"] == "content_block_delta"
                and e["delta"]["type"] == "text_delta"]
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "tool_use"


async def test_a_harmony_answer_without_tools_is_the_final_channel(served: Served) -> None:
    served.writes("<|channel|>final<|message|>It is noon in Berlin.<|return|>")
    message = (await served.chat()).json()["choices"][0]["message"]
    assert message["content"] == "It is noon in Berlin." and "reasoning_content" not in message
    deltas = await served.chat_stream()
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "It is noon in Berlin."
    r = await served.client.post("/v1/messages", json={
        "model": served.generator.info.model_id, "messages": ASK, "max_tokens": 64})
    assert r.json()["content"] == [{"type": "text", "text": "It is noon in Berlin."}]


async def test_harmony_reasoning_is_reasoning_content_never_content(served: Served) -> None:
    served.writes(THINK + "<|start|>assistant<|channel|>final<|message|>It is noon.<|return|>")
    message = (await served.chat()).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants the time in Berlin."
    assert message["content"] == "It is noon."
    deltas = await served.chat_stream()
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == \
        "The user wants the time in Berlin."
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "It is noon."
