"""The official openai client against a real daemon's gateway over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from greedy import Greedy, cut, greedy  # type: ignore[import-not-found]

from kvasird.localnet.demo import SYSTEM
from kvasird.text.chat import Message
from tests.support import eventually

pytestmark = pytest.mark.slow

GATEWAY_SETTINGS = {"gateway.ping_s": 0.01}
"""Pings between tokens (about every other one here): the client must skip them."""

QUESTION = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the capital of France?"}]
"""The demo's question and system prompt: its greedy answer ends within 16 tokens here, so
the end-of-generation stop is exercised. Texts are compared with the engine's, `answer`."""


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def answer() -> Greedy:
    """The engine's greedy answer to QUESTION in 16 tokens: what the gateway must say."""
    return greedy([Message(**m) for m in QUESTION], 16)


def test_models_lists_the_served_model_by_its_name(client: openai.OpenAI,
                                                   daemon: Daemon) -> None:
    [model] = client.models.list()
    assert model.id == "smollm2:135m-instruct"
    assert model.model_extra is not None and model.model_extra["model_id"] == daemon.model


def test_chat_completion_answers_with_usage_from_the_tokenizer(
        client: openai.OpenAI, daemon: Daemon, answer: Greedy) -> None:
    r = client.chat.completions.create(model=daemon.model, messages=QUESTION, temperature=0,
                                       max_tokens=16)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == answer.text
    assert choice.finish_reason == ("stop" if answer.stopped else "length")
    assert r.usage is not None
    assert r.usage.prompt_tokens == daemon.prompt_tokens([Message(**m) for m in QUESTION])
    assert r.usage.completion_tokens == answer.tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_equals_the_whole_answer(client: openai.OpenAI, daemon: Daemon,
                                               answer: Greedy) -> None:
    whole = client.chat.completions.create(model=daemon.model, messages=QUESTION, temperature=0,
                                           max_tokens=16)
    chunks = list(client.chat.completions.create(
        model=daemon.model, messages=QUESTION, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop" if answer.stopped else "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_the_raw_stream_is_data_events_ending_with_done(daemon: Daemon) -> None:
    body = {"model": daemon.model, "messages": QUESTION, "temperature": 0, "max_tokens": 12,
            "stream": True}
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith(("data: {", ": ping")) for line in lines[:-1])
    assert lines[-1] == "data: [DONE]"


def test_max_tokens_ends_with_length(client: openai.OpenAI, daemon: Daemon) -> None:
    r = client.chat.completions.create(model=daemon.model, messages=QUESTION, temperature=0,
                                       max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_a_stop_sequence_cuts_the_text_before_it(client: openai.OpenAI, daemon: Daemon,
                                                  answer: Greedy) -> None:
    before, stop, _ = cut(answer.text)
    args = {"model": daemon.model, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
    r = client.chat.completions.create(**args, stop=[stop])
    assert r.choices[0].message.content == before
    assert r.choices[0].finish_reason == "stop"
    assert "never" not in answer.text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **args, stop=[stop, "never"], stream=True) if c.choices)
    assert streamed == before


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, daemon: Daemon) -> None:
    args = {"model": daemon.model, "messages": [{"role": "user", "content": "Tell me a story."}],
            "temperature": 1.0, "max_tokens": 12, "seed": 1234}
    first = client.chat.completions.create(**args).choices[0].message.content
    again = client.chat.completions.create(**args).choices[0].message.content
    assert first == again and first


def test_logprobs_cover_every_generated_token(client: openai.OpenAI, daemon: Daemon) -> None:
    r = client.chat.completions.create(model=daemon.model, messages=QUESTION, temperature=0,
                                       max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert r.usage is not None and len(content) == r.usage.completion_tokens == 4
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token


def test_text_completion_continues_a_prompt(client: openai.OpenAI, daemon: Daemon) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=daemon.model, prompt=prompt, temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(daemon.tokenizer.encode(prompt))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=daemon.model, prompt=prompt, temperature=0, max_tokens=4, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_a_disconnected_client_frees_its_generation(daemon: Daemon) -> None:
    body = {"model": daemon.model, "messages": QUESTION, "max_tokens": 1000, "stream": True,
            "temperature": 1.0, "seed": 3}
    before = httpx.get(daemon.url + "/status").json()["gateway"]["requests_by_status"]
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                break

    def settled() -> dict[str, Any] | None:
        status = httpx.get(daemon.url + "/status").json()["gateway"]
        return None if status["in_flight"] else status

    status = eventually("the abandoned generation ends", settled, timeout=10, every=0.05)
    assert status["in_flight"] == 0
    assert status["requests_by_status"].get("499", 0) == before.get("499", 0) + 1
