"""Issue #39's findings 1, 3 and 8, each through HTTP: on a real daemon (the bundled model, its
gateway local), and, for a model that reasons, on a gateway whose model writes harmony
(test_harmony's scripted gpt-oss: no small real model writes an analysis channel).

1  an output limit past the context is clamped and reported, not refused; the prompt limit
   is the model's context, or [gateway] max_prompt_tokens when that is set smaller
3  Anthropic thinking, OpenAI reasoning_effort and the Responses API's reasoning are
   accepted; a model without a reasoning mode ignores them and the reply says so; one with
   it gets the effort and answers with thinking blocks and reasoning items
8  DELETE /v1/responses/{id}; echo, several prompts and token arrays in legacy completions;
   a body declared as nothing or as a form is read as JSON; a malformed body is a 400;
   /v1/models in Anthropic's shape for an Anthropic client
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from test_harmony import ASK, THINK, Served, served  # type: ignore[import-not-found]

from kvasird.config import GatewayConfig
from kvasird.gateway.errors import BadRequest
from kvasird.gateway.service import REASONING_IGNORED, Gateway
from kvasird.inference.api import ModelInfo
from kvasird.localnet.demo import SYSTEM
from kvasird.text.chat import Message

__all__ = ["served"]  # test_harmony's fixture: a gateway whose model writes harmony

QUESTION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def oa(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def an(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def context(daemon: Daemon) -> int:
    return int(httpx.get(daemon.url + "/v1/models", timeout=10).json()["data"][0]["context_length"])


def post(daemon: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(daemon.url + path, json={"model": daemon.model, **body}, timeout=120)


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def malformed(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return str(err["message"])


# --- 1: limits ----------------------------------------------------------------------------


@pytest.mark.slow
def test_an_openai_max_tokens_past_the_context_is_clamped_and_reported(
    oa: openai.OpenAI, daemon: Daemon, context: int
) -> None:
    raw = oa.chat.completions.with_raw_response.create(
        model=daemon.model,
        messages=QUESTION,
        max_tokens=100_000,  # type: ignore[arg-type]
        temperature=0,
    )
    reply = raw.parse()
    left = context - daemon.prompt_tokens([Message(**m) for m in QUESTION])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.model_extra == {"requested_max_tokens": 100_000, "clamped_max_tokens": left}
    assert raw.headers["x-kvasir-max-tokens"].startswith(f"{left} (`max_tokens` 100000 ")


@pytest.mark.slow
def test_a_streamed_max_completion_tokens_past_the_context_is_clamped_and_reported(
    daemon: Daemon, context: int
) -> None:
    r = post(
        daemon,
        CHAT,
        {
            "messages": QUESTION,
            "max_completion_tokens": 10**6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200, r.text
    assert "`max_completion_tokens` 1000000" in r.headers["x-kvasir-max-tokens"]
    usage = sse(r)[-1]["usage"]
    assert usage["requested_max_tokens"] == 10**6
    assert usage["clamped_max_tokens"] == context - usage["prompt_tokens"]


@pytest.mark.slow
def test_an_anthropic_and_a_responses_limit_past_the_context_are_clamped(
    an: anthropic.Anthropic, daemon: Daemon, context: int
) -> None:
    raw = an.messages.with_raw_response.create(
        model=daemon.model,
        max_tokens=20_000,  # the SDK wants a stream past ~21k
        extra_body={"temperature": 0},
        system=SYSTEM,
        messages=[QUESTION[1]],
    )  # type: ignore[list-item]
    message = raw.parse()
    assert message.stop_reason == "end_turn" and "x-kvasir-max-tokens" in raw.headers
    assert message.usage.model_extra == {
        "requested_max_tokens": 20_000,
        "clamped_max_tokens": context
        - message.usage.input_tokens
        - (message.usage.cache_read_input_tokens or 0),
    }

    r = post(
        daemon, "/v1/responses", {"input": "Say hi.", "max_output_tokens": 50_000, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["max_output_tokens"] == body["usage"]["clamped_max_tokens"] < 50_000
    assert body["usage"]["requested_max_tokens"] == 50_000


@pytest.mark.slow
def test_a_limit_within_the_context_is_kept_and_none_is_the_gateways_default(
    daemon: Daemon,
) -> None:
    r = post(daemon, CHAT, {"messages": QUESTION, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and "x-kvasir-max-tokens" not in r.headers
    assert set(r.json()["usage"]) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    r = post(daemon, "/v1/responses", {"input": "Say hi.", "temperature": 0})
    assert r.json()["max_output_tokens"] == GatewayConfig().max_tokens


@pytest.mark.slow
def test_the_prompt_limit_is_the_models_context(daemon: Daemon, context: int) -> None:
    r = post(daemon, COMPLETIONS, {"prompt": [42] * context, "max_tokens": 1})
    message = malformed(r)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert f"the model's context of {context} tokens" in message
    assert "max_prompt_tokens" not in message


def test_a_smaller_configured_prompt_limit_is_named_in_the_refusal() -> None:
    gw = Gateway(GatewayConfig(max_prompt_tokens=8))
    with pytest.raises(BadRequest, match=r"\[gateway\] max_prompt_tokens.*: 8$"):
        gw.check_prompt(ModelInfo("m", "m", 4096), list(range(9)), "messages")
    assert gw.check_prompt(ModelInfo("m", "m", 4096), list(range(8)), "messages")


# --- 3: thinking and reasoning on a model without a reasoning mode --------------------------


@pytest.mark.slow
def test_anthropic_thinking_is_accepted_and_ignored_by_a_model_that_does_not_reason(
    an: anthropic.Anthropic, daemon: Daemon
) -> None:
    raw = an.messages.with_raw_response.create(
        model=daemon.model,
        max_tokens=8192,
        extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 4000},
        system=SYSTEM,
        messages=[
            QUESTION[1],  # type: ignore[list-item]
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "France.", "signature": "x"},
                    {"type": "text", "text": "Paris."},
                ],
            },
            {"role": "user", "content": "And of Italy?"},
        ],
    )
    assert raw.headers["x-kvasir-reasoning"] == REASONING_IGNORED
    assert [b.type for b in raw.parse().content] == ["text"]
    with an.messages.stream(
        model=daemon.model,
        max_tokens=16,
        system=SYSTEM,
        messages=[QUESTION[1]],  # type: ignore[list-item]
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["text"] and streamed.content[0].text


@pytest.mark.slow
def test_reasoning_effort_in_chat_and_responses_is_accepted_and_said_to_be_ignored(
    daemon: Daemon,
) -> None:
    r = post(daemon, CHAT, {"messages": QUESTION, "max_tokens": 4, "reasoning_effort": "high"})
    assert r.status_code == 200 and r.headers["x-kvasir-reasoning"] == REASONING_IGNORED
    r = post(
        daemon,
        "/v1/responses",
        {"input": "Hi", "max_output_tokens": 4, "reasoning": {"effort": "minimal"}},
    )
    assert r.status_code == 200 and r.headers["x-kvasir-reasoning"] == REASONING_IGNORED
    assert r.json()["reasoning"] == {"effort": "minimal"}
    r = post(daemon, CHAT, {"messages": QUESTION, "max_tokens": 4})
    assert "x-kvasir-reasoning" not in r.headers
    assert malformed(post(daemon, CHAT, {"messages": QUESTION, "reasoning_effort": "max"}))


# --- 3: a model that reasons (harmony) ------------------------------------------------------

FINAL = "<|start|>assistant<|channel|>final<|message|>It is noon.<|return|>"


async def test_anthropic_thinking_gets_the_reasoning_as_a_thinking_block(served: Served) -> None:
    served.writes(THINK + FINAL)
    body = {
        "model": served.generator.info.model_id,
        "messages": ASK,
        "max_tokens": 64,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    r = await served.client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvasir-reasoning"] == "on (effort low)"
    assert "Reasoning: low" in served.tok.decode(served.generator.prompts[-1])
    assert r.json()["content"] == [
        {"type": "thinking", "thinking": "The user wants the time in Berlin.", "signature": ""},
        {"type": "text", "text": "It is noon."},
    ]

    r = await served.client.post("/v1/messages", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The user wants the time in Berlin."
    assert [d["type"] for d in deltas if d["type"] == "signature_delta"] == ["signature_delta"]

    del body["thinking"]
    r = await served.client.post("/v1/messages", json=body)
    assert r.json()["content"] == [{"type": "text", "text": "It is noon."}]
    assert "Reasoning" not in served.tok.decode(served.generator.prompts[-1])


async def test_reasoning_effort_sets_the_templates_effort_and_responses_get_a_reasoning_item(
    served: Served,
) -> None:
    served.writes(THINK + FINAL)
    r = await served.chat(reasoning_effort="high")
    assert r.headers["x-kvasir-reasoning"] == "on (effort high)"
    assert "Reasoning: high" in served.tok.decode(served.generator.prompts[-1])
    assert (
        r.json()["choices"][0]["message"]["reasoning_content"]
        == "The user wants the time in Berlin."
    )

    body = {
        "model": served.generator.info.model_id,
        "input": "What time is it in Berlin?",
        "reasoning": {"effort": "medium"},
    }
    output = (await served.client.post("/v1/responses", json=body)).json()["output"]
    assert [i["type"] for i in output] == ["reasoning", "message"]
    assert output[0]["content"] == [
        {"type": "reasoning_text", "text": "The user wants the time in Berlin."}
    ]
    r = await served.client.post("/v1/responses", json={**body, "stream": True})
    kinds = [
        json.loads(line[6:])["type"] for line in r.text.splitlines() if line.startswith("data: ")
    ]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    plain = (
        await served.client.post(
            "/v1/responses", json={"model": served.generator.info.model_id, "input": "Hi"}
        )
    ).json()["output"]
    assert [i["type"] for i in plain] == ["message"]


# --- 8: smaller findings --------------------------------------------------------------------


@pytest.mark.slow
def test_a_stored_response_can_be_deleted_as_openai_deletes_it(
    oa: openai.OpenAI, daemon: Daemon
) -> None:
    made = oa.responses.create(model=daemon.model, input="Hi", max_output_tokens=4)
    r = httpx.delete(f"{daemon.url}/v1/responses/{made.id}", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": made.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.delete(made.id)


@pytest.mark.slow
def test_legacy_completions_echo_the_prompt(daemon: Daemon) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    plain = post(daemon, COMPLETIONS, body).json()["choices"][0]["text"]
    echoed = post(daemon, COMPLETIONS, {**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "The capital of France is" + plain
    streamed = sse(post(daemon, COMPLETIONS, {**body, "echo": True, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == echoed
    assert "`echo`" in malformed(post(daemon, COMPLETIONS, {**body, "echo": True, "logprobs": 1}))


@pytest.mark.slow
def test_legacy_completions_answer_each_of_several_prompts(
    oa: openai.OpenAI, daemon: Daemon
) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [
        oa.completions.create(model=daemon.model, prompt=p, max_tokens=3, temperature=0)
        for p in prompts
    ]
    both = oa.completions.create(
        model=daemon.model, prompt=prompts, max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + [
        alone[1].choices[0].text
    ] * 2
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    ids = [daemon.tokenizer.encode(p) for p in prompts]
    as_ids = oa.completions.create(model=daemon.model, prompt=ids, max_tokens=3, temperature=0)
    assert [c.text for c in as_ids.choices] == [a.choices[0].text for a in alone]


@pytest.mark.slow
@pytest.mark.parametrize("headers", [{}, {"content-type": "application/x-www-form-urlencoded"}])
def test_a_body_declared_as_nothing_or_as_a_form_is_read_as_json(
    daemon: Daemon, headers: dict[str, str]
) -> None:
    body = json.dumps({"model": daemon.model, "messages": QUESTION, "max_tokens": 2})
    r = httpx.post(daemon.url + CHAT, content=body.encode(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"model": "m", "temperature": NaN}', "NaN"),
        (b'{"model": "m", "temperature": -Infinity}', "-Infinity"),
        (b'{"model": "m", "messages": "\xff\xfe"}', "not valid UTF-8"),
        (b'{"model": "m", "metadata": {"a": "\\ud800"}}', "lone UTF-16 surrogate"),
    ],
)
@pytest.mark.parametrize("headers", [JSON, {}])
def test_a_malformed_body_is_a_400_that_says_what_to_fix(
    daemon: Daemon, content: bytes, says: str, headers: dict[str, str]
) -> None:
    r = httpx.post(daemon.url + CHAT, content=content, headers=headers, timeout=30)
    assert says in malformed(r)


@pytest.mark.slow
def test_an_anthropic_client_lists_the_models_in_anthropics_shape(
    an: anthropic.Anthropic, oa: openai.OpenAI, daemon: Daemon
) -> None:
    (listed,) = an.models.list().data
    name = oa.models.list().data[0].id
    assert (listed.type, listed.id, listed.display_name) == ("model", name, name)
    page = httpx.get(
        daemon.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}, timeout=10
    ).json()
    assert (page["has_more"], page["first_id"], page["last_id"]) == (False, name, name)
    assert an.models.retrieve(daemon.model).id == name
