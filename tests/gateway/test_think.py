"""A model with a think-tag reasoning mode (Qwen3's ``enable_thinking``) through a gateway on
loopback: its think block is OpenAI's reasoning_content and Anthropic's thinking block,
never content; ``reasoning_effort: "none"`` and an Anthropic request without ``thinking``
turn the mode off in the prompt, ``thinking`` turns it on.

The model is a GGUF holding only a tokenizer (the bundled vocabulary) and a chat template
with Qwen3's switch; a scripted Generator writes the reply (tests/gateway/test_harmony.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasird.text.tokenizer import Tokenizer

from .test_harmony import Scripted, scripted_gateway, template_model

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What time is it in Berlin?"}]
THOUGHT = "The user wants the time in Berlin."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\nIt is noon."
OFF = "<think>\n\n</think>\n\n"
"""What the template writes where the mode is off."""


class Served:
    def __init__(self, client: httpx.AsyncClient, generator: Scripted, tok: Tokenizer) -> None:
        self.client, self.generator, self.tok = client, generator, tok
        self.generator.script = tok.encode(REPLY, special=True)

    def prompt(self) -> str:
        """The text of the last prompt the model was asked to continue."""
        return self.tok.decode(list(self.generator.prompts[-1]))

    async def chat(self, **body: Any) -> httpx.Response:
        r = await self.client.post("/v1/chat/completions", json={
            "model": self.generator.info.model_id, "messages": ASK, **body})
        assert r.status_code == 200, r.text
        return r

    async def message(self, **body: Any) -> httpx.Response:
        r = await self.client.post("/v1/messages", json={
            "model": self.generator.info.model_id, "messages": ASK, "max_tokens": 64, **body})
        assert r.status_code == 200, r.text
        return r


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    path = template_model(tmp_path / "think.gguf", "qwen3", TEMPLATE, [])
    async with scripted_gateway(path) as (client, generator):
        yield Served(client, generator, Tokenizer.from_gguf(path))


def events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


async def test_the_think_block_is_reasoning_content_never_content(served: Served) -> None:
    r = await served.chat()
    assert not served.prompt().endswith(OFF)  # asked nothing: the template's default (on)
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, "It is noon.")
    deltas = [c["choices"][0]["delta"] for c in events(await served.chat(stream=True))
              if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == "It is noon."


async def test_reasoning_effort_none_turns_the_mode_off_in_the_prompt(served: Served) -> None:
    served.generator.script = served.tok.encode("It is noon.", special=True)
    r = await served.chat(reasoning_effort="none")
    assert served.prompt().endswith(OFF) and r.headers["x-kvasir-reasoning"] == "off"
    assert r.json()["choices"][0]["message"]["content"] == "It is noon."
    r = await served.chat(reasoning_effort="high")
    assert not served.prompt().endswith(OFF) and r.headers["x-kvasir-reasoning"] == "on"


async def test_anthropic_thinks_only_when_asked_and_shows_it_as_a_thinking_block(
        served: Served) -> None:
    served.generator.script = served.tok.encode("It is noon.", special=True)
    r = await served.message()
    assert served.prompt().endswith(OFF)
    assert r.json()["content"] == [{"type": "text", "text": "It is noon."}]

    served.generator.script = served.tok.encode(REPLY, special=True)
    thinking = {"type": "enabled", "budget_tokens": 2048}
    r = await served.message(thinking=thinking)
    assert not served.prompt().endswith(OFF)
    assert r.json()["content"] == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                   {"type": "text", "text": "It is noon."}]
    streamed = events(await served.message(thinking=thinking, stream=True))
    deltas = [e["delta"] for e in streamed if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == THOUGHT
    assert "".join(d.get("text", "") for d in deltas) == "It is noon."


async def test_a_template_that_opens_the_block_gets_a_reply_read_from_inside_it(
        tmp_path: Path) -> None:
    """Qwen3-Thinking and DeepSeek-R1 templates end the prompt with <think>: the model
    writes its reasoning, then </think>, then the answer."""
    opening = TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
    path = template_model(tmp_path / "opens.gguf", "qwen3", opening, [])
    async with scripted_gateway(path) as (client, generator):
        tok = Tokenizer.from_gguf(path)
        generator.script = tok.encode(f"{THOUGHT}\n</think>\n\nIt is noon.", special=True)
        r = await client.post("/v1/chat/completions", json={
            "model": generator.info.model_id, "messages": ASK})
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, "It is noon.")
        assert tok.decode(list(generator.prompts[-1])).endswith("<think>\n")
