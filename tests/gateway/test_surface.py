"""The rest of OpenAI's surface, with the official client against a real daemon's gateway:
`n` choices, one model by its name, `created`, special tokens in raw completion prompts,
and CORS for the pages the operator allowed."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]

from kvasird.model.bundled import bundled_path
from kvasird.model.names import slug
from kvasird.text.chat import ChatTemplate, Message
from tests.support import eventually

pytestmark = pytest.mark.slow

UI = "http://localhost:5173"
GATEWAY_SETTINGS = {"gateway.max_n": 4, "gateway.cors_origins": [UI], "gateway.kv_tokens": 5120}
"""KV room for one request of 4 choices of 1000 tokens, not for two."""
STORY = [{"role": "user", "content": "Tell me a story."}]
MARKUP = [Message("user", "What is the capital of France?")]


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def plain(gateway_daemons: Callable[[dict[str, Any]], Daemon]) -> Daemon:
    """A daemon with the defaults of the new keys' neighbours: no CORS, and raw prompts
    read as plain text."""
    return gateway_daemons({
        "market.model": str(bundled_path()), "market.memory_budget_mb": 200,
        "market.target_replicas": 1, "market.heartbeat_s": 1.0, "market.enroll_delay_s": 0.0,
        "compute.threads": 1, "gateway.local": True, "gateway.parse_special": False})


def chat(client: openai.OpenAI, daemon: Daemon, **args: Any) -> Any:
    """A chat completion of STORY, 8 tokens unless told otherwise."""
    return client.chat.completions.create(  # type: ignore[call-overload]
        model=daemon.model, messages=STORY, **{"max_tokens": 8, **args})


# --- n choices -------------------------------------------------------------------------


def test_n_choices_are_independent_samples_counted_in_usage(client: openai.OpenAI,
                                                           daemon: Daemon) -> None:
    r = chat(client, daemon, n=3, temperature=1.0, seed=11, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, f"three samples at temperature 1 came out alike: {texts}"
    assert r.usage.prompt_tokens == daemon.prompt_tokens([Message(**m) for m in STORY])
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = chat(client, daemon, n=3, temperature=1.0, seed=11, logprobs=True)
    assert [c.message.content for c in again.choices] == texts
    alone = chat(client, daemon, temperature=1.0, seed=11)
    assert alone.choices[0].message.content == texts[0]


def test_greedy_choices_are_all_alike(client: openai.OpenAI, daemon: Daemon) -> None:
    one = chat(client, daemon, temperature=0).choices[0].message.content
    r = chat(client, daemon, n=3, temperature=0)
    assert [c.message.content for c in r.choices] == [one] * 3


def test_streamed_choices_carry_their_index_and_end_once(client: openai.OpenAI,
                                                         daemon: Daemon) -> None:
    args = {"n": 2, "temperature": 1.0, "seed": 5}
    whole = chat(client, daemon, **args)
    chunks = list(chat(client, daemon, **args, stream=True,
                       stream_options={"include_usage": True}))
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert dict(texts) == {c.index: c.message.content for c in whole.choices}
    assert dict(finishes) == {c.index: [c.finish_reason] for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    body = {"model": daemon.model, "messages": STORY, "max_tokens": 4, "n": 2, "stream": True}
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines.count("data: [DONE]") == 1 and lines[-1] == "data: [DONE]"


def test_text_completions_take_n_too(client: openai.OpenAI, daemon: Daemon) -> None:
    args = {"model": daemon.model, "prompt": "Once upon a time", "max_tokens": 6,
            "temperature": 1.0, "seed": 3, "n": 2}
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1] and all(c.text for c in r.choices)
    assert r.usage.prompt_tokens == len(daemon.tokenizer.encode("Once upon a time"))
    assert r.usage.completion_tokens == 12  # both ran to max_tokens: no stop in 6 tokens
    streamed: dict[int, str] = defaultdict(str)
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert dict(streamed) == {c.index: c.text for c in r.choices}


def started_choices(daemon: Daemon, n: int) -> set[int]:
    """Stream n long choices and leave once each has sent text; the indices seen by then
    (an error event, such as no KV room for one of them, ends the wait early)."""
    body = {"model": daemon.model, "messages": STORY, "max_tokens": 1000, "n": n,
            "stream": True, "temperature": 1.0}
    seen: set[int] = set()
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                break
            seen |= {c["index"] for c in chunk["choices"] if c["delta"].get("content")}
            if len(seen) == n:
                break
    return seen


def test_a_client_that_leaves_frees_every_choice(daemon: Daemon) -> None:
    for _ in range(2):
        assert started_choices(daemon, 4) == {0, 1, 2, 3}
        eventually("the abandoned choices end", lambda: not httpx.get(
            daemon.url + "/status").json()["gateway"]["in_flight"], timeout=10, every=0.05)


@pytest.mark.parametrize("n", [0, 5])
def test_n_outside_one_to_max_n_is_a_400_naming_the_key(client: openai.OpenAI, daemon: Daemon,
                                                        n: int) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, daemon, n=n)
    assert info.value.body["param"] == "n"  # type: ignore[index]
    if n > 1:
        assert "[gateway] max_n" in info.value.body["message"]  # type: ignore[index]


def test_a_quote_for_n_choices_is_refused_without_settlement_as_any_quote(
        daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/v1/kvasir/quote", json={"max_tokens": 4, "n": 9}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# --- models ------------------------------------------------------------------------------


def test_one_model_is_found_by_every_name_the_list_gives(client: openai.OpenAI,
                                                        daemon: Daemon) -> None:
    listed = httpx.get(daemon.url + "/v1/models").json()["data"][0]
    assert listed["created"] > 0
    for name in (daemon.model, daemon.model[:12], listed["name"], slug(listed["name"])):
        m = client.models.retrieve(name)
        assert (m.id, m.object, m.created, m.owned_by) == (
            listed["id"], "model", listed["created"], listed["owned_by"])


def test_an_unknown_model_is_a_404_in_openais_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    body = info.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"  # type: ignore[index]
    assert "no-such-model" in body["message"]  # type: ignore[index]


def test_completions_and_chat_are_created_now(client: openai.OpenAI, daemon: Daemon) -> None:
    assert chat(client, daemon, max_tokens=1).created > 1_700_000_000
    assert client.completions.create(model=daemon.model, prompt="Hi", max_tokens=1).created \
        > 1_700_000_000


# --- special tokens in raw prompts -------------------------------------------------------


def markup(daemon: Daemon) -> str:
    return ChatTemplate.of(daemon.tokenizer).render(MARKUP)


def test_chat_markup_in_a_raw_prompt_means_what_the_template_means(
        client: openai.OpenAI, daemon: Daemon) -> None:
    text = markup(daemon)
    raw = client.completions.create(model=daemon.model, prompt=text, max_tokens=12,
                                    temperature=0)
    assert raw.usage.prompt_tokens == len(daemon.tokenizer.encode(text, special=True))
    templated = client.chat.completions.create(
        model=daemon.model, messages=[{"role": "user", "content": MARKUP[0].content}],
        max_tokens=12, temperature=0)
    assert templated.usage.prompt_tokens == raw.usage.prompt_tokens
    assert raw.choices[0].text == templated.choices[0].message.content


def test_parse_special_off_reads_raw_prompts_as_plain_text(plain: Daemon) -> None:
    text = markup(plain)
    with openai.OpenAI(base_url=plain.url + "/v1", api_key="-", max_retries=0) as c:
        raw = c.completions.create(model=plain.model, prompt=text, max_tokens=1)
        templated = c.chat.completions.create(
            model=plain.model, messages=[{"role": "user", "content": MARKUP[0].content}],
            max_tokens=1)
    assert raw.usage.prompt_tokens == len(plain.tokenizer.encode(text))
    assert raw.usage.prompt_tokens > len(plain.tokenizer.encode(text, special=True))
    assert templated.usage.prompt_tokens == plain.prompt_tokens(MARKUP)


# --- CORS --------------------------------------------------------------------------------


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_an_allowed_page_gets_preflight_and_cors_headers(daemon: Daemon) -> None:
    r = preflight(daemon.url, UI)
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == UI
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "content-type" in r.headers["access-control-allow-headers"].lower()
    body = {"model": daemon.model, "messages": STORY, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Origin": UI}) as streamed:
        assert streamed.headers["access-control-allow-origin"] == UI
        assert list(streamed.iter_lines())
    models = httpx.get(daemon.url + "/v1/models", headers={"Origin": UI})
    assert models.headers["access-control-allow-origin"] == UI


def test_other_pages_get_no_cors_headers(daemon: Daemon) -> None:
    other = "http://localhost:3000"
    assert "access-control-allow-origin" not in preflight(daemon.url, other).headers
    r = httpx.get(daemon.url + "/v1/models", headers={"Origin": other})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_is_off_by_default(plain: Daemon) -> None:
    r = preflight(plain.url, UI)
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in httpx.get(
        plain.url + "/v1/models", headers={"Origin": UI}).headers
