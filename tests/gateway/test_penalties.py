"""Presence and frequency penalties and logit_bias through the official openai client
against a real one-node daemon: accepted, carried to the head's sampler, and checked."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from greedy import greedy  # type: ignore[import-not-found]

from kvasird.compute.sampling import SamplingParams
from kvasird.text.chat import Message

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def forced(daemon: Daemon) -> int:
    """A one-token word the model would not say here."""
    [token] = daemon.tokenizer.encode(" banana")
    return token


def test_a_bias_of_100_on_one_token_makes_the_greedy_answer_that_token(
        client: openai.OpenAI, daemon: Daemon) -> None:
    token = forced(daemon)
    r = client.chat.completions.create(model=daemon.model, messages=QUESTION, temperature=0,
                                       max_tokens=3, logit_bias={str(token): 100})
    assert r.choices[0].message.content == daemon.tokenizer.decode([token] * 3)
    assert r.choices[0].finish_reason == "length"


def test_legacy_completions_take_the_bias_too(client: openai.OpenAI, daemon: Daemon) -> None:
    token = forced(daemon)
    r = client.completions.create(model=daemon.model, prompt="The capital of France is",
                                  temperature=0, max_tokens=2, logit_bias={str(token): 100},
                                  presence_penalty=0.5, frequency_penalty=0.5)
    assert r.choices[0].text == daemon.tokenizer.decode([token] * 2)


def test_penalties_and_a_ban_answer_as_the_engine_samples_with_them(
        client: openai.OpenAI, daemon: Daemon) -> None:
    """The gateway's answer is the engine's greedy answer under the same bias and penalties,
    and not the unpenalised one: the settings reach the head's sampler."""
    messages = [Message(**m) for m in QUESTION]
    plain = greedy(messages, 12)
    first = daemon.tokenizer.encode(plain.text)[0]
    params = SamplingParams(frequency_penalty=1.5, presence_penalty=1.0,
                            logit_bias=((first, -100.0),))
    want = greedy(messages, 12, params)
    r = client.chat.completions.create(model=daemon.model, messages=QUESTION, temperature=0,
                                       max_tokens=12, frequency_penalty=1.5, presence_penalty=1.0,
                                       logit_bias={str(first): -100})
    assert r.choices[0].message.content == want.text
    assert want.text != plain.text
    assert r.usage is not None and r.usage.completion_tokens == want.tokens


def test_a_streamed_answer_with_penalties_equals_the_whole_one(
        client: openai.OpenAI, daemon: Daemon) -> None:
    settings = dict(model=daemon.model, messages=QUESTION, temperature=0, max_tokens=8,
                    frequency_penalty=-0.5, presence_penalty=2.0)
    whole = client.chat.completions.create(**settings)  # type: ignore[call-overload]
    chunks = client.chat.completions.create(stream=True, **settings)  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


@pytest.mark.parametrize(("field", "value", "param", "says"), [
    ("presence_penalty", 2.5, "presence_penalty", "between -2 and 2"),
    ("frequency_penalty", -3, "frequency_penalty", "between -2 and 2"),
    ("logit_bias", {"49152": 1}, "logit_bias", "0..49151"),
    ("logit_bias", {"hello": 1}, "logit_bias", "token ids"),
    ("logit_bias", {"-3": 1}, "logit_bias", "token ids"),
    ("logit_bias", {"12": 101}, "logit_bias.12", "between -100 and 100"),
    ("logit_bias", {"12": "up"}, "logit_bias.12", "must be a number"),
    ("logit_bias", {"12": 1, "012": 2}, "logit_bias", "twice"),
    ("logit_bias", [[12, 1]], "logit_bias", "must be an object"),
    ("repeat_last_n", -1, "repeat_last_n", "between 0 and"),
])
def test_a_bad_penalty_or_bias_is_a_400_that_says_what_is_allowed(
        client: openai.OpenAI, daemon: Daemon, field: str, value: object, param: str,
        says: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=daemon.model, messages=QUESTION, max_tokens=2,
                                       extra_body={field: value})
    assert info.value.body["param"] == param  # type: ignore[index]
    assert says in info.value.body["message"]  # type: ignore[index]
