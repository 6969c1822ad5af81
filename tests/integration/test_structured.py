"""Structured output through the gateway of a 3-node ring, with the official openai client:
`response_format` json_schema (20 schemas) and json_object, stream and not; a schema the
server cannot follow is a 400 naming the parameter."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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


def test_json_schema_and_json_object_output_validates_through_a_ring(
        localnet: Callable[..., LocalNet]) -> None:
    net = start(localnet, bundled_path(), PLACEMENT)
    client = openai.OpenAI(base_url=net.nodes[0].status()["gateway"] + "/v1", api_key="local",
                           max_retries=0, timeout=120)
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
