"""Bad input gets a 4xx in the API's own error shape, naming the field; the daemon carries on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack

import anthropic
import httpx
import openai
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]

from tests.support import eventually

pytestmark = pytest.mark.slow

GATEWAY_SETTINGS = {"gateway.max_concurrent": 2, "gateway.max_tokens": 64,
                    "gateway.max_prompt_tokens": 200}

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def oa(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def post(daemon: Daemon, path: str, content: bytes) -> httpx.Response:
    return httpx.post(daemon.url + path, content=content, timeout=30,
                      headers={"content-type": "application/json"})


def openai_error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err  # type: ignore[no-any-return]


def test_malformed_json_is_a_400_saying_so(daemon: Daemon) -> None:
    err = openai_error(post(daemon, CHAT, b'{"model": '), 400)
    assert "not valid JSON" in str(err["message"])


def test_invalid_utf8_is_a_400_saying_so(daemon: Daemon) -> None:
    body = b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    assert "not valid UTF-8" in str(openai_error(post(daemon, CHAT, body), 400)["message"])


def test_a_lone_surrogate_is_a_400_naming_the_field(daemon: Daemon) -> None:
    body = json.dumps({"model": daemon.model, "messages": [
        {"role": "user", "content": "\ud800"}]}).encode()
    assert openai_error(post(daemon, CHAT, body), 400)["param"] == "messages[0].content"


def test_a_huge_body_is_a_413(daemon: Daemon) -> None:
    body = json.dumps({"model": daemon.model, "messages": HI, "pad": "x" * (2 << 20)}).encode()
    assert "max_body_bytes" in str(openai_error(post(daemon, CHAT, body), 413)["message"])


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "ten"), ("max_tokens", -5), ("max_tokens", 0),
    ("temperature", "hot"), ("temperature", 3), ("top_p", 0), ("n", 99), ("stop", 7),
    ("messages", "hello"), ("stream", "yes"), ("seed", 1.5)])
def test_a_wrong_field_is_a_400_naming_it(oa: openai.OpenAI, daemon: Daemon, field: str,
                                          value: object) -> None:
    body = {"model": daemon.model, "messages": HI, "max_tokens": 4, field: value}
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(**body)  # type: ignore[call-overload]
    assert info.value.status_code == 400
    assert info.value.body["param"] == field  # type: ignore[index]


def test_a_message_with_an_unknown_role_names_it(daemon: Daemon) -> None:
    body = json.dumps({"model": daemon.model, "messages": [{"role": "wizard", "content": "x"}]})
    assert openai_error(post(daemon, CHAT, body.encode()), 400)["param"] == "messages[0].role"


def test_a_too_long_prompt_is_a_400_context_length_exceeded(daemon: Daemon) -> None:
    body = json.dumps({"model": daemon.model, "messages": [
        {"role": "user", "content": "word " * 400}]}).encode()
    assert openai_error(post(daemon, CHAT, body), 400)["code"] == "context_length_exceeded"


def test_an_unknown_model_is_a_404_in_both_apis(oa: openai.OpenAI, daemon: Daemon) -> None:
    with pytest.raises(openai.NotFoundError, match="not served"):
        oa.chat.completions.create(model="gpt-9", messages=HI)  # type: ignore[arg-type]
    with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0) as an, \
            pytest.raises(anthropic.NotFoundError) as info:
        an.messages.create(model="claude-9", messages=HI, max_tokens=4)  # type: ignore[arg-type]
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_anthropic_errors_have_anthropics_shape(daemon: Daemon) -> None:
    r = post(daemon, "/v1/messages", json.dumps({"model": daemon.model, "messages": HI,
                                                 "max_tokens": -1}).encode())
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "`max_tokens` must be at least 1, got -1"}}
    r = post(daemon, "/v1/messages", json.dumps({"model": daemon.model, "messages": HI}).encode())
    assert r.status_code == 400 and "`max_tokens` is required" in r.json()["error"]["message"]


def test_an_unknown_path_is_a_json_404(daemon: Daemon) -> None:
    r = httpx.get(daemon.url + "/v1/engines")
    assert openai_error(r, 404)["type"] == "invalid_request_error"


def test_generations_past_the_concurrency_limit_are_a_429(daemon: Daemon) -> None:
    body = {"model": daemon.model, "messages": HI, "max_tokens": 64, "stream": True,
            "temperature": 1.0, "seed": 5}
    with ExitStack() as stack:
        for _ in range(2):
            r = stack.enter_context(httpx.stream("POST", daemon.url + CHAT, json=body, timeout=30))
            assert r.status_code == 200
        err = openai_error(httpx.post(daemon.url + CHAT, json=body, timeout=30), 429)
        assert "max_concurrent" in str(err["message"])
    eventually("closed streams free their slots", lambda: not httpx.get(
        daemon.url + "/status").json()["gateway"]["in_flight"], timeout=10, every=0.05)


def test_the_daemon_still_answers_after_all_of_it(oa: openai.OpenAI, daemon: Daemon) -> None:
    assert daemon.node.alive()
    r = oa.chat.completions.create(model=daemon.model, messages=HI, max_tokens=4)  # type: ignore[arg-type]
    assert r.choices[0].message.content
    assert httpx.get(daemon.url + "/health").json()["status"] == "ok"
