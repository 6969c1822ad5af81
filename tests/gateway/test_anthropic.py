"""The official anthropic client against a real daemon's gateway over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from greedy import Greedy, cut, greedy  # type: ignore[import-not-found]

from kvasird.localnet.demo import SYSTEM
from kvasird.text.chat import Message

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
"""The SDK no longer has a temperature argument; the field still exists on the wire."""
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
"""Asked with the demo's system prompt: its greedy answer ends within 16 tokens here, so
end_turn is exercised. Texts are compared with the engine's, `answer`."""
PREFILL = "The capital of France is"


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0,
                             timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def answer() -> Greedy:
    """The engine's greedy answer to SYSTEM and QUESTION in 16 tokens."""
    return greedy([Message("system", SYSTEM), Message("user", QUESTION[0]["content"])], 16)


def stop_reason(answer: Greedy) -> str:
    return "end_turn" if answer.stopped else "max_tokens"


def test_message_answers_with_usage_from_the_tokenizer(client: anthropic.Anthropic,
                                                       daemon: Daemon, answer: Greedy) -> None:
    m = client.messages.create(model=daemon.model, system=SYSTEM, messages=QUESTION,  # type: ignore[arg-type]
                               max_tokens=16, extra_body=GREEDY)
    assert m.role == "assistant" and m.type == "message"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == answer.text  # type: ignore[union-attr]
    assert m.stop_reason == stop_reason(answer) and m.stop_sequence is None
    assert m.usage.input_tokens == daemon.prompt_tokens(
        [Message("system", SYSTEM), Message("user", QUESTION[0]["content"])])
    assert m.usage.output_tokens == answer.tokens


def test_count_tokens_equals_the_usage_of_a_message(client: anthropic.Anthropic,
                                                    daemon: Daemon) -> None:
    counted = client.messages.count_tokens(model=daemon.model, system=SYSTEM,
                                           messages=QUESTION)  # type: ignore[arg-type]
    m = client.messages.create(model=daemon.model, system=SYSTEM, messages=QUESTION,  # type: ignore[arg-type]
                               max_tokens=1, extra_body=GREEDY)
    assert counted.input_tokens == m.usage.input_tokens


def test_streamed_message_equals_the_whole_answer(client: anthropic.Anthropic,
                                                  daemon: Daemon, answer: Greedy) -> None:
    args = {"model": daemon.model, "system": SYSTEM, "messages": QUESTION, "max_tokens": 16,
            "extra_body": GREEDY}
    whole = client.messages.create(**args)  # type: ignore[call-overload]
    with client.messages.stream(**args) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == stop_reason(answer)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_the_raw_stream_is_the_documented_event_sequence(daemon: Daemon) -> None:
    body = {"model": daemon.model, "messages": QUESTION, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", daemon.url + "/v1/messages", json=body, timeout=60) as r:
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events == ["message_start", "content_block_start", "ping",
                      *["content_block_delta"] * (len(events) - 6),
                      "content_block_stop", "message_delta", "message_stop"]
    assert len(events) > 6


def test_max_tokens_ends_with_max_tokens(client: anthropic.Anthropic, daemon: Daemon) -> None:
    m = client.messages.create(model=daemon.model, messages=QUESTION, max_tokens=3,  # type: ignore[arg-type]
                               extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_a_stop_sequence_is_reported_and_cut(client: anthropic.Anthropic, daemon: Daemon,
                                             answer: Greedy) -> None:
    before, stop, after = cut(answer.text)
    # `after` is listed first but comes later in the text: the sequence met first wins
    args = {"model": daemon.model, "system": SYSTEM, "messages": QUESTION, "max_tokens": 16,
            "extra_body": GREEDY, "stop_sequences": [after, stop]}
    m = client.messages.create(**args)  # type: ignore[call-overload]
    assert m.content[0].text == before
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**args) as stream:  # type: ignore[arg-type]
        assert "".join(stream.text_stream) == before
        assert stream.get_final_message().stop_sequence == stop


def test_an_assistant_prefill_is_continued(client: anthropic.Anthropic, daemon: Daemon) -> None:
    prefilled = [Message("system", SYSTEM), Message("user", QUESTION[0]["content"]),
                 Message("assistant", PREFILL)]
    m = client.messages.create(model=daemon.model, system=SYSTEM, max_tokens=8, extra_body=GREEDY,
                               messages=[*QUESTION, {"role": "assistant",  # type: ignore[list-item]
                                                     "content": PREFILL}])
    assert m.content[0].text == greedy(prefilled, 8).text  # type: ignore[union-attr]


def test_the_same_prompt_gives_the_same_text_through_both_apis(
        client: anthropic.Anthropic, daemon: Daemon) -> None:
    question = [{"role": "user", "content": "Name three colours."}]
    m = client.messages.create(model=daemon.model, system=SYSTEM, messages=question,  # type: ignore[arg-type]
                               max_tokens=12, extra_body=GREEDY)
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as oa:
        r = oa.chat.completions.create(
            model=daemon.model, max_tokens=12, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, *question])  # type: ignore[list-item]
    assert r.choices[0].message.content == m.content[0].text  # type: ignore[union-attr]
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        m.usage.input_tokens, m.usage.output_tokens)
