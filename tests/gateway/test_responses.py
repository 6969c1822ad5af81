"""The Responses API on one daemon's gateway: text.format, stored conversations, and the
errors that name the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]

pytestmark = pytest.mark.slow

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                "maximum": 99}},
         "required": ["x"], "additionalProperties": False}


def respond(daemon: Daemon, **body: object) -> httpx.Response:
    return httpx.post(daemon.url + "/v1/responses", timeout=120,
                      json={"model": daemon.model, "max_output_tokens": 30, **body})


def test_a_json_schema_text_format_holds_the_output(daemon: Daemon) -> None:
    r = respond(daemon, input="Give me a point.", temperature=0,
                text={"format": {"type": "json_schema", "name": "p", "schema": POINT}})
    assert r.status_code == 200, r.text
    (message,) = r.json()["output"]
    jsonschema.validate(json.loads(message["content"][0]["text"]), POINT)


def test_a_stored_response_continues_and_an_unstored_one_cannot(daemon: Daemon) -> None:
    first = respond(daemon, input="My name is Ada.", temperature=0).json()
    again = respond(daemon, input="What is my name?", previous_response_id=first["id"],
                    temperature=0)
    assert again.status_code == 200 and again.json()["previous_response_id"] == first["id"]
    longer = again.json()["usage"]["input_tokens"]
    alone = respond(daemon, input="What is my name?", temperature=0).json()
    assert longer > alone["usage"]["input_tokens"]  # the first turn is in the prompt
    private = respond(daemon, input="Hi", store=False).json()
    r = httpx.get(f"{daemon.url}/v1/responses/{private['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "Hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": POINT}],
      "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, 400,
     "text.format"),
])
def test_a_request_it_cannot_answer_names_the_field(daemon: Daemon, body: dict, status: int,
                                                     param: str) -> None:
    r = respond(daemon, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
