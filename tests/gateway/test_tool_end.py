"""Forced tool calls that end, and strict JSON that validates, on one daemon's gateway with
the official clients and an OpenAI Agents SDK agent (issue 39, findings 5 and 6).

A forced call ends after one call unless the client asked for parallel calls itself, and
then after at most MAX_PARALLEL_CALLS; a call the token limit cuts off is never returned.
Numbers in a schema's documents are bounded in length, so a strict schema's answers fit the
tokens the schema needs. Sampled runs are seeded (Chat Completions takes a seed), so that a
failure repeats, but for the agent's, which sets nothing, as an agent does; runs through the
other APIs are greedy."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]

from kvasird.text.toolcalls.calls import MAX_PARALLEL_CALLS

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": CITY,
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris, Rome and Oslo?"}]


def openai_client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="local", max_retries=0, timeout=120)


def anthropic_client(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="local", max_retries=0, timeout=120)


def test_an_agent_forcing_its_tool_with_default_settings_completes_every_run(
    daemon: Daemon,
) -> None:
    """openai-agents with ``tool_choice="required"`` and nothing else set (no
    parallel_tool_calls, no max_tokens, no temperature, no seed): 20 runs, each stopping at
    the tool's result; then one whole run per API, greedy, where the tool's result goes back
    and the agent answers. Unset sampling settings are the model's defaults, llama-server's
    for the bundled model (min-p 0.05 among them): at OpenAI's temperature 1 over the whole
    vocabulary the 135M model left a string argument open once in about 100 runs, with
    them it did not in 200."""
    import agents

    client = openai.AsyncOpenAI(
        base_url=daemon.url + "/v1", api_key="local", max_retries=0, timeout=120
    )
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return json.dumps({"city": city, "temperature": 18, "sky": "clear"})

    def run(model: agents.Model, behaviour: Any, **settings: Any) -> agents.RunResult:
        agent = agents.Agent(
            name="weather",
            instructions="Answer questions about the weather.",
            model=model,
            tools=[get_weather],
            tool_use_behavior=behaviour,
            model_settings=agents.ModelSettings(tool_choice="required", **settings),
        )
        return agents.Runner.run_sync(
            agent,
            "What is the weather in Paris?",
            max_turns=4,
            run_config=agents.RunConfig(tracing_disabled=True),
        )

    chat = agents.OpenAIChatCompletionsModel(daemon.model, client)
    for i in range(20):
        result = run(chat, "stop_on_first_tool")
        assert len(asked) == i + 1  # one call a run, its arguments JSON the SDK could read
        assert json.loads(result.final_output)["city"] == asked[-1]

    for model in (agents.OpenAIResponsesModel(daemon.model, client), chat):
        result = run(model, "run_llm_again", temperature=0)
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
        assert isinstance(result.final_output, str)


def test_a_forced_call_is_one_call_unless_parallel_calls_are_asked_for(daemon: Daemon) -> None:
    client = openai_client(daemon)
    for seed in range(3):
        reply = client.chat.completions.create(
            model=daemon.model, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), CITY)

        reply = client.chat.completions.create(
            model=daemon.model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            parallel_tool_calls=True,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), CITY)

    response = client.responses.create(
        model=daemon.model,
        input=ASK[0]["content"],
        tool_choice="required",
        temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": CITY}],
    )
    assert response.status == "completed"
    (call,) = [o for o in response.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_anthropic_tool_choice_any_stops_on_tool_use_with_no_empty_text_block(
    daemon: Daemon,
) -> None:
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}]
    with anthropic_client(daemon) as client:
        message = client.messages.create(
            model=daemon.model,
            messages=ASK,
            tools=tools,
            max_tokens=1024,
            tool_choice={"type": "any"},
            extra_body={"temperature": 0},
        )
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["tool_use"]
        jsonschema.validate(message.content[0].input, CITY)

        with client.messages.stream(
            model=daemon.model,
            messages=ASK,
            tools=tools,
            max_tokens=1024,
            tool_choice={"type": "any"},
            extra_body={"temperature": 0},
        ) as stream:
            started = [e.content_block.type for e in stream if e.type == "content_block_start"]
            streamed = stream.get_final_message()
    assert started == ["tool_use"]
    assert streamed.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == ["tool_use"]
    jsonschema.validate(streamed.content[0].input, CITY)


def test_a_call_the_token_limit_cuts_off_is_never_returned(daemon: Daemon) -> None:
    """20 tokens open the call and end inside its arguments: what comes back is the reply
    without it, marked as cut by the limit."""
    client = openai_client(daemon)
    reply = client.chat.completions.create(
        model=daemon.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=20,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "length"
    assert not reply.choices[0].message.tool_calls

    response = client.responses.create(
        model=daemon.model,
        input=ASK[0]["content"],
        tool_choice="required",
        max_output_tokens=20,
        temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": CITY}],
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert not [o for o in response.output if o.type == "function_call"]

    with anthropic_client(daemon) as anthropic_api:
        message = anthropic_api.messages.create(
            model=daemon.model,
            messages=ASK,
            max_tokens=20,
            tool_choice={"type": "any"},
            tools=[{"name": "get_weather", "input_schema": CITY}],
            extra_body={"temperature": 0},
        )
    assert message.stop_reason == "max_tokens"
    assert not [b for b in message.content if b.type == "tool_use"]


def schemas() -> list[dict[str, Any]]:
    """20 strict schemas of the kinds agents send, each with a number (what ran on until
    max_tokens): bare and bounded numbers, integers, arrays of numbers and a nested point,
    beside a short string, an enum or a boolean."""
    number = {"type": "number"}
    numeric = [
        number,
        {"type": "number", "minimum": -10, "maximum": 10},
        {"type": "integer"},
        {"type": "array", "items": number, "maxItems": 3},
        {
            "type": "object",
            "properties": {"lat": number, "lon": number},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    ]
    other = [
        {"type": "string", "maxLength": 16},
        {"enum": ["low", "high"]},
        {"type": "boolean"},
        {"type": "integer", "minimum": 0, "maximum": 999},
    ]
    props = [{f"a{i}": numeric[i % 5], f"b{i}": other[i % 4]} for i in range(20)]
    return [
        {"type": "object", "properties": p, "required": list(p), "additionalProperties": False}
        for p in props
    ]


def test_strict_json_schema_answers_all_validate_at_the_tokens_the_schema_needs(
    daemon: Daemon,
) -> None:
    """Sampled at the default temperature, each seeded so the run repeats: the answer ends by
    itself within 96 tokens and validates, 20 of 20."""
    client = openai_client(daemon)
    messages = [{"role": "user", "content": "Describe your favourite place as JSON."}]
    for i, schema in enumerate(schemas()):
        reply = client.chat.completions.create(
            model=daemon.model,
            messages=messages,
            max_tokens=96,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
