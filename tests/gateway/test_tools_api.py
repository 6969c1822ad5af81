"""Tools on one daemon's gateway: what a request may offer and force, the errors that name
the field, and a forced call through the local engine in both APIs."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]

pytestmark = pytest.mark.slow

TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "est"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Now, in a zone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What time is it in Berlin?"}]


def chat(daemon: Daemon, **body: object) -> httpx.Response:
    return httpx.post(daemon.url + "/v1/chat/completions", timeout=120,
                      json={"model": daemon.model, "messages": ASK, "max_tokens": 40, **body})


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": TIME}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_a_tool_request_it_cannot_honour_is_a_400_naming_the_field(
        daemon: Daemon, body: dict, param: str) -> None:
    r = chat(daemon, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_forced_call_through_the_local_engine_in_both_apis(daemon: Daemon) -> None:
    r = chat(daemon, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
             temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)

    r = httpx.post(daemon.url + "/v1/messages", timeout=120, json={
        "model": daemon.model, "messages": ASK, "max_tokens": 40,
        "tools": [{"name": "get_time", "input_schema": TIME}],
        "tool_choice": {"type": "tool", "name": "get_time"}})
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["stop_reason"] == "tool_use"
    (use,) = [b for b in message["content"] if b["type"] == "tool_use"]
    assert use["id"].startswith("toolu_")
    jsonschema.validate(use["input"], TIME)


def test_tool_choice_none_offers_no_tools_and_auto_may_answer_in_text(daemon: Daemon) -> None:
    plain = chat(daemon, temperature=0).json()["choices"][0]["message"]["content"]
    none = chat(daemon, tools=TOOLS, tool_choice="none", temperature=0).json()
    assert none["choices"][0]["message"]["content"] == plain
    auto = chat(daemon, tools=TOOLS, temperature=0).json()["choices"][0]
    assert auto["finish_reason"] in ("stop", "length", "tool_calls")
    tokens = httpx.post(daemon.url + "/v1/messages/count_tokens", json={
        "model": daemon.model, "messages": ASK,
        "tools": [{"name": "get_time", "input_schema": TIME}]}).json()["input_tokens"]
    bare = httpx.post(daemon.url + "/v1/messages/count_tokens", json={
        "model": daemon.model, "messages": ASK}).json()["input_tokens"]
    assert tokens > bare  # the tools are in the prompt
