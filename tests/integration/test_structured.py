"""Structured output and tool calls through the gateway of a 3-node ring, with the official
openai and anthropic clients: `response_format` json_schema (20 schemas) and json_object,
stream and not; a forced tool call whose arguments validate (both APIs, stream and not, the
arguments streamed as they are written); a two-turn tool loop; the Responses API with a
function call round trip; n = 3; an OpenAI Agents SDK agent running a tool-using task."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from test_swarm import start  # type: ignore[import-not-found]

from kvasird.localnet import LocalNet
from kvasird.model.bundled import bundled_path

pytestmark = pytest.mark.slow

PLACEMENT = [["head", "layers:0-10"], ["layers:10-20"], ["layers:20-30"]]


def schemas() -> list[dict[str, Any]]:
    """20 schemas of the kinds agents send: flat and nested objects, enums, bounded
    numbers and strings, arrays, optional fields."""
    word = {"type": "string", "maxLength": 16}
    small = {"type": "integer", "minimum": 0, "maximum": 999}
    flag = {"type": "boolean"}
    colour = {"enum": ["red", "green", "blue"]}
    out = []
    kinds = [word, small, flag, colour, {"type": "number", "minimum": -10, "maximum": 10},
             {"type": "array", "items": colour, "maxItems": 3},
             {"type": "array", "items": small, "minItems": 1, "maxItems": 2},
             {"type": "object", "properties": {"x": small, "y": small},
              "required": ["x", "y"], "additionalProperties": False}]
    names = ["name", "count", "ok", "colour", "score", "tags", "ids", "point"]
    for i in range(20):
        a, b = kinds[i % len(kinds)], kinds[(i * 3 + 1) % len(kinds)]
        props = {names[i % 8]: a, f"{names[(i * 3 + 1) % 8]}_{i}": b}
        required = list(props) if i % 3 else list(props)[:1]
        if i % 5 == 4:
            props = {"item": {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}}
            required = ["item"]
        out.append({"type": "object", "properties": props, "required": required,
                    "additionalProperties": False})
    return out


@pytest.fixture(scope="module")
def gateway(module_tmp: Callable[[str], Path]) -> Iterator[str]:
    """The gateway URL of a 3-node ring of the bundled model."""
    net = LocalNet(module_tmp("ring"), len(PLACEMENT))
    with net:
        start(lambda n: net, bundled_path(), PLACEMENT)
        yield net.nodes[0].status()["gateway"]


def test_json_schema_and_json_object_output_validates_through_a_ring(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="local", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Describe your favourite thing as JSON."}]
    for i, schema in enumerate(schemas()):
        reply = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=120,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)

    schema = schemas()[13]
    chunks = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=120, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)

    reply = client.chat.completions.create(
        model=model, temperature=0, max_tokens=400, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Tell me a joke."}])
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {
                    "a": {"$ref": "#/definitions/nowhere"}}}}})
    assert caught.value.body["param"] == "response_format"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_forced_tool_call_validates_and_a_tool_loop_completes_with_openai(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="local", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    tools = [{"type": "function", "function": {"name": "get_weather", "description":
                                               "The weather in a city", "parameters": WEATHER}}]
    reply = client.chat.completions.create(model=model, messages=ASK, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(client.chat.completions.create(
        model=model, messages=ASK, tools=tools, temperature=0, max_tokens=80, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in streamed if d.function.name] == ["get_weather"]
    assert len([d for d in streamed if d.function.arguments]) > 1  # sent as it is written
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in streamed)),
                        WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    final = client.chat.completions.create(model=model, messages=turn, tools=tools,
                                           temperature=0, max_tokens=40)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


def test_a_forced_tool_use_validates_with_anthropic(gateway: str) -> None:
    with anthropic.Anthropic(base_url=gateway, api_key="local", max_retries=0,
                             timeout=120) as client:
        model = openai.OpenAI(base_url=gateway + "/v1", api_key="x").models.list().data[0].id
        tools = [{"name": "get_weather", "description": "The weather in a city",
                  "input_schema": WEATHER}]
        reply = client.messages.create(model=model, messages=ASK, tools=tools, max_tokens=80,
                                       tool_choice={"type": "any",
                                                    "disable_parallel_tool_use": True},
                                       extra_body={"temperature": 0})
        assert reply.stop_reason == "tool_use"
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert len(uses) == 1
        for use in uses:
            assert use.name == "get_weather"
            jsonschema.validate(use.input, WEATHER)

        with client.messages.stream(model=model, messages=ASK, tools=tools, max_tokens=80,
                                    tool_choice={"type": "tool", "name": "get_weather"}) as s:
            pieces = [e for e in s if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta"]
            message = s.get_final_message()
        assert len(pieces) > 1  # the input sent as it is written
        assert message.stop_reason == "tool_use"
        streamed = [b for b in message.content if b.type == "tool_use"]
        assert streamed
        for use in streamed:
            jsonschema.validate(use.input, WEATHER)

        results = [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temperature": 18}'}
                   for use in uses]
        answer = client.messages.create(model=model, max_tokens=40, tools=tools,
                                        messages=[*ASK, {"role": "assistant", "content": [
                                            use.model_dump() for use in uses]},
                                                  {"role": "user", "content": results}])
        assert answer.content


def test_the_responses_api_answers_streams_and_round_trips_a_function_call(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="local", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, instructions="Answer in one short sentence.",
                                    input="What is the capital of France?", temperature=0,
                                    max_output_tokens=24)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.output_tokens > 0 and first.id.startswith("resp_")

    events = list(client.responses.create(model=model, input="Say hello.", temperature=0,
                                          max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER}]
    called = client.responses.create(model=model, input="What is the weather in Paris?",
                                     tools=tools, tool_choice="required", temperature=0,
                                     parallel_tool_calls=False, max_output_tokens=80)
    (call,) = [o for o in called.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(model=model, input="What is the weather in Paris?",
                                          tools=tools, tool_choice="required", temperature=0,
                                          parallel_tool_calls=False, max_output_tokens=80,
                                          stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == call.arguments
    answer = client.responses.create(
        model=model, previous_response_id=called.id, tools=tools, temperature=0,
        max_output_tokens=30, input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": '{"temperature": 18}'}])
    assert answer.output and answer.previous_response_id == called.id
    assert client.responses.retrieve(answer.id).id == answer.id


def test_three_choices_through_the_ring(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="local", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=ASK, n=3, temperature=1.0,
                                           seed=5, max_tokens=8)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1  # sampled independently
    assert 3 <= reply.usage.completion_tokens <= 3 * 8  # every choice's tokens


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_openai_agents_sdk_agent_calls_its_tool_and_answers(gateway: str, api: str) -> None:
    """The OpenAI Agents SDK runs a tool-using task against the gateway: the model is made to
    call the tool once (the SDK then resets tool_choice to auto), the SDK runs the Python
    function, sends its result back and the agent ends with an answer."""
    import agents

    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="local", max_retries=0,
                                timeout=120)
    model_id = openai.OpenAI(base_url=gateway + "/v1", api_key="x").models.list().data[0].id
    model = (agents.OpenAIResponsesModel(model_id, client) if api == "responses"
             else agents.OpenAIChatCompletionsModel(model_id, client))
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return json.dumps({"city": city, "temperature": 18, "sky": "clear"})

    agent = agents.Agent(name="weather", instructions="Answer questions about the weather.",
                         model=model, tools=[get_weather],
                         model_settings=agents.ModelSettings(
                             tool_choice="required", parallel_tool_calls=False, temperature=0,
                             max_tokens=100))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=6,
                                    run_config=agents.RunConfig(tracing_disabled=True))
    assert asked and all(isinstance(c, str) and c for c in asked)
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(calls) == len(outputs) == len(asked)
    assert isinstance(result.final_output, str) and result.final_output
