"""llama-server's operations endpoints on a real daemon's gateway: a Prometheus scrape of
/metrics that moves with the requests served, /tokenize and /detokenize as the model's own
tokenizer, /apply-template as the chat endpoint's prompt, /props, and CORS preflights."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from prometheus_client.parser import text_string_to_metric_families

from kvasird.text.chat import ChatTemplate, Message
from tests.support import eventually

pytestmark = pytest.mark.slow

UI = "http://localhost:5173"
GATEWAY_SETTINGS = {"gateway.cors_origins": [UI]}
ASKED_HEADERS = "authorization, content-type, x-stainless-os"
"""What a page's preflight asks to send: an SDK adds headers of its own."""
CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
]
STORY = [{"role": "user", "content": "Tell me a story."}]
TEXT = "Grüße aus Kvasir 🦙 <|im_start|>user\n42 + 高山"
"""Accents, an emoji and CJK (bytes that split across tokens), and a control token's text."""


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


def post(daemon: Daemon, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(daemon.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# --- /metrics ----------------------------------------------------------------------------


def scrape(daemon: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape of /metrics, as Prometheus's text parser reads it, by name
    and labels."""
    r = httpx.get(daemon.url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def chat_served(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    key = (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200"))
    return samples.get(("kvasird_http_requests_total", key), 0.0)


def test_a_scrape_parses_and_its_counters_move_with_requests(
    client: openai.OpenAI, daemon: Daemon
) -> None:
    before = scrape(daemon)
    whole = client.chat.completions.create(
        model=daemon.model,
        messages=STORY,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    usage = [whole.usage]
    for chunk in client.chat.completions.create(  # type: ignore[call-overload]
        model=daemon.model,
        messages=STORY,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage:
            usage.append(chunk.usage)

    def counted() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        samples = scrape(daemon)
        return samples if chat_served(samples) == chat_served(before) + 2 else None

    after = eventually("both chat requests are counted", counted, timeout=10)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert moved("kvasird_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    generated = sum(u.completion_tokens for u in usage)
    assert moved("kvasird_generated_tokens_total") == generated
    assert moved("kvasird_generations_total", status="200") == 2
    assert moved("kvasird_time_to_first_token_seconds_count") == 2
    assert moved("kvasird_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert moved("kvasird_time_to_first_token_seconds_sum") > 0
    gaps = moved("kvasird_token_gap_seconds_count")
    assert 2 <= gaps <= generated - 2, "a gap is counted for each token after a choice's first"
    assert moved("kvasird_token_gap_seconds_bucket", le="+Inf") == gaps
    assert moved("kvasird_http_requests_total", method="GET", route="/metrics", status="200") >= 1
    assert after["kvasird_generations_limit", ()] == 16
    assert after["kvasird_peers_connected", ()] == 0, "a one-node network"
    eventually(
        "the node's own coverage record is online",
        lambda: scrape(daemon).get(("kvasird_peers_known", (("state", "online"),)), 0) >= 1,
        timeout=30,
    )
    assert after["kvasird_gateway_ready", ()] == 1
    assert after["kvasird_stage_sessions", ()] == 0, "it generates itself: no route's stage"
    assert after["process_resident_memory_bytes", ()] > 0
    eventually(
        "nothing is left in flight",
        lambda: (
            (s := scrape(daemon))["kvasird_generations_in_flight", ()] == 0
            and s["kvasird_generations_waiting", ()] == 0
        ),
        timeout=10,
    )


def test_a_request_no_route_takes_is_counted_without_its_path(daemon: Daemon) -> None:
    assert httpx.get(daemon.url + "/no/such/path/7f3a", timeout=10).status_code == 404
    text = httpx.get(daemon.url + "/metrics", timeout=10).text
    assert "7f3a" not in text
    assert 'kvasird_http_requests_total{method="GET",route="other",status="404"}' in text


def test_a_scrape_relayed_by_a_proxy_is_refused_naming_the_key(daemon: Daemon) -> None:
    r = httpx.get(daemon.url + "/metrics", timeout=10, headers={"X-Forwarded-For": "203.0.113.9"})
    assert r.status_code == 403
    assert '[gateway] metrics = "any"' in r.json()["error"]["message"]


# --- /tokenize, /detokenize --------------------------------------------------------------


def test_tokenize_and_detokenize_are_the_models_tokenizer(daemon: Daemon) -> None:
    tok = daemon.tokenizer
    ids = post(daemon, "/tokenize", {"content": TEXT})["tokens"]
    assert ids == tok.encode(TEXT, special=True)
    assert any(tok.is_control(t) for t in ids), "the marker is read as its token"
    plain = post(daemon, "/tokenize", {"content": TEXT, "parse_special": False})["tokens"]
    assert plain == tok.encode(TEXT) and not any(tok.is_control(t) for t in plain)
    with_bos = post(daemon, "/tokenize", {"content": TEXT, "add_special": True})["tokens"]
    assert with_bos == ([tok.special.bos] if tok.special.add_bos else []) + ids
    assert post(daemon, "/detokenize", {"tokens": ids}) == {"content": TEXT}
    assert post(daemon, "/detokenize", {"tokens": plain}) == {"content": TEXT}


def test_pieces_are_each_tokens_text_or_its_bytes(daemon: Daemon) -> None:
    pieces = post(daemon, "/tokenize", {"content": TEXT, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == daemon.tokenizer.encode(TEXT, special=True)
    assert any(isinstance(p["piece"], list) for p in pieces), "the emoji splits across tokens"
    raw = b"".join(
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces
    )
    assert raw.decode() == TEXT


def test_detokenize_refuses_an_id_outside_the_vocabulary_naming_it(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/detokenize", json={"tokens": [1, 10**9]}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tokens[1]"


# --- /apply-template, /props -------------------------------------------------------------


def test_apply_template_is_the_prompt_the_chat_endpoint_builds(
    client: openai.OpenAI, daemon: Daemon
) -> None:
    prompt = post(daemon, "/apply-template", {"messages": CHAT})["prompt"]
    assert prompt == ChatTemplate.of(daemon.tokenizer).render([Message(**m) for m in CHAT])
    ids = post(daemon, "/tokenize", {"content": prompt})["tokens"]
    served = client.chat.completions.create(
        model=daemon.model,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert served.usage is not None and served.usage.prompt_tokens == len(ids)


def test_props_describe_the_model_its_template_and_the_chat_defaults(daemon: Daemon) -> None:
    r = httpx.get(daemon.url + "/props", timeout=10)
    assert r.status_code == 200, r.text
    props = r.json()
    model = httpx.get(daemon.url + "/v1/models", timeout=10).json()["data"][0]
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == model["context_length"]
    # the bundled GGUF recommends nothing: llama-server's defaults
    params = settings["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (
        0.8, 40, 0.95, 0.05)
    assert settings["params"]["n_predict"] == settings["params"]["max_tokens"] == 1024
    assert props["total_slots"] == 16
    assert props["model_path"] == model["id"] and props["model_id"] == daemon.model
    assert props["chat_template"] == daemon.tokenizer.chat_template
    assert props["eos_token"] == daemon.tokenizer.tokens[daemon.tokenizer.special.eos]
    assert props["build_info"].startswith("kvasird ")


# --- CORS --------------------------------------------------------------------------------


def preflight(daemon: Daemon, origin: str, method: str = "POST", **extra: str) -> httpx.Response:
    return httpx.options(
        daemon.url + "/v1/chat/completions",
        timeout=10,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": ASKED_HEADERS,
            **extra,
        },
    )


def test_a_preflight_from_a_configured_page_is_granted(daemon: Daemon) -> None:
    r = preflight(daemon, UI, **{"Access-Control-Request-Private-Network": "true"})
    assert r.status_code == 204 and not r.content
    assert r.headers["access-control-allow-origin"] == UI
    assert {"GET", "POST", "DELETE"} <= set(r.headers["access-control-allow-methods"].split(", "))
    assert r.headers["access-control-allow-headers"] == ASKED_HEADERS
    assert r.headers["access-control-max-age"] == "600"
    assert r.headers["access-control-allow-private-network"] == "true"
    assert preflight(daemon, UI, "DELETE").status_code == 204


def test_a_configured_page_may_read_the_payment_and_kvasir_headers(daemon: Daemon) -> None:
    """An x402 client in a browser reads PAYMENT-REQUIRED and PAYMENT-RESPONSE, and an app
    the x-kvasir-* headers: a browser hides response headers not exposed to it."""
    r = httpx.post(daemon.url + "/v1/chat/completions", timeout=60, headers={"Origin": UI},
                   json={"model": daemon.model, "max_tokens": 1, "reasoning_effort": "none",
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    exposed = set(r.headers["access-control-expose-headers"].lower().split(", "))
    assert {"payment-required", "payment-response", "x-kvasir-max-tokens",
            "x-kvasir-reasoning"} <= exposed
    assert "x-kvasir-reasoning" in r.headers


def test_a_preflight_from_another_page_is_refused_naming_the_key(daemon: Daemon) -> None:
    other = "http://localhost:3000"
    r = preflight(daemon, other)
    assert r.status_code == 403
    assert not any(h.startswith("access-control-allow") for h in r.headers)
    message = r.json()["error"]["message"]
    assert f"add '{other}' to [gateway] cors_origins" in message
    refused = preflight(daemon, UI, "PUT")
    assert refused.status_code == 403 and "PUT" in refused.json()["error"]["message"]
