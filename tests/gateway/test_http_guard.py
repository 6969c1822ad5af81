"""The HTTP surfaces refuse what a web page could send them: foreign Host or Origin (DNS
rebinding, CSRF), bodies that are not declared JSON, JSON nested past any sane depth.

The gateway here is real (served by hypercorn on a free loopback port) but has no model:
a request that passes every check ends at its 503 "not_ready", one that fails ends earlier.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anthropic
import httpx
import openai
import pytest
import trio
from starlette.applications import Starlette
from starlette.types import Message, Receive, Scope, Send

from kvasird.config import GatewayConfig, load_text
from kvasird.errors import ConfigError
from kvasird.gateway.app import build_app
from kvasird.gateway.service import Gateway
from kvasird.http import HostGuard, is_loopback, serve_asgi

CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}
HI = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
async def gateway() -> AsyncIterator[httpx.AsyncClient]:
    """A client of a served gateway that also answers to the name kvasir.lan."""
    gw = Gateway(GatewayConfig(listen="127.0.0.1:0", allowed_hosts=("kvasir.lan",)),
                 config_path="/etc/kvasird/kvasird.toml")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(gw.run)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield client
        nursery.cancel_scope.cancel()


def error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["type"] == "invalid_request_error"
    return str(body["message"])


# --- Host and Origin ----------------------------------------------------------------------

async def test_a_foreign_host_is_refused_naming_the_key_to_set(
        gateway: httpx.AsyncClient) -> None:
    message = error(await gateway.get("/v1/models", headers={"host": "evil.example:8080"}), 421)
    assert "'evil.example'" in message
    assert "[gateway] allowed_hosts in /etc/kvasird/kvasird.toml" in message


@pytest.mark.parametrize("host", ["localhost:8080", "LocalHost", "127.0.0.1:8080", "127.9.8.7",
                                  "[::1]:8080", "[::1]", "kvasir.lan:8080", "KVASIR.lan"])
async def test_loopback_and_allowed_hosts_are_served(gateway: httpx.AsyncClient,
                                                     host: str) -> None:
    assert (await gateway.get("/v1/models", headers={"host": host})).status_code == 200


@pytest.mark.parametrize("host", ["", "127.0.0.1.evil.example", "localhost.evil.example",
                                  "::1", "[::1", "a:b:c", "localhost:http"])
async def test_a_host_that_is_not_a_loopback_or_allowed_name_is_refused(
        gateway: httpx.AsyncClient, host: str) -> None:
    error(await gateway.get("/v1/models", headers={"host": host}), 421)


async def test_a_page_of_another_site_is_refused_naming_the_key_to_set(
        gateway: httpx.AsyncClient) -> None:
    r = await gateway.post(CHAT, json=HI, headers={"origin": "https://evil.example"})
    message = error(r, 403)
    assert "https://evil.example" in message
    assert "[gateway] allowed_hosts in /etc/kvasird/kvasird.toml" in message


@pytest.mark.parametrize("origin", ["null", "file://", "evil"])
async def test_an_origin_without_a_host_is_refused(gateway: httpx.AsyncClient,
                                                   origin: str) -> None:
    error(await gateway.post(CHAT, json=HI, headers={"origin": origin}), 403)


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:8080",
                                    "http://[::1]:8080", "https://kvasir.lan"])
async def test_pages_on_loopback_or_an_allowed_host_are_served(gateway: httpx.AsyncClient,
                                                               origin: str) -> None:
    r = await gateway.post(CHAT, json=HI, headers={"origin": origin})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


async def lan_client(bind: str, allowed_hosts: tuple[str, ...] = (),
                     favours_this_machine: bool = True) -> httpx.AsyncClient:
    guarded = HostGuard(build_app(Gateway(GatewayConfig())), bind, allowed_hosts, what="gateway",
                        hint="[gateway] allowed_hosts in kvasird.toml",
                        favours_this_machine=favours_this_machine)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded),
                             base_url=f"http://{bind}")


async def test_a_gateway_bound_to_a_non_loopback_address_answers_to_that_address() -> None:
    async with await lan_client("203.0.113.5:8080") as client:
        assert (await client.get("/v1/models")).status_code == 200
        r = await client.get("/v1/models", headers={"host": "203.0.113.6:8080"})
        assert r.status_code == 421


@pytest.mark.parametrize("bind", ["0.0.0.0:8080", "[::]:8080"])
async def test_a_wildcard_bind_address_is_no_name_to_answer_to(bind: str) -> None:
    async with await lan_client(bind) as client:
        assert (await client.get("/v1/models")).status_code == 421


@pytest.mark.parametrize("bind", ["0.0.0.0:8080", "[::]:8080"])
@pytest.mark.parametrize("host", ["gateway.example", "gateway.example:443", "203.0.113.6:8080",
                                  "[2001:db8::6]:8080", "localhost"])
async def test_on_every_address_a_gateway_that_favours_this_machine_in_nothing_answers_any_host(
        bind: str, host: str) -> None:
    async with await lan_client(bind, favours_this_machine=False) as client:
        assert (await client.get("/v1/models", headers={"host": host})).status_code == 200


async def test_a_gateway_that_answers_any_host_still_refuses_pages_of_other_sites() -> None:
    async with await lan_client("0.0.0.0:8080", favours_this_machine=False) as client:
        r = await client.post(CHAT, json=HI, headers={"host": "rebound.example",
                                                      "origin": "http://rebound.example"})
        assert "http://rebound.example" in error(r, 403)


async def test_allowed_hosts_on_every_address_are_the_only_names_answered() -> None:
    async with await lan_client("0.0.0.0:8080", ("kvasir.lan",), False) as client:
        assert (await client.get("/v1/models", headers={"host": "kvasir.lan"})).status_code == 200
        assert "'gateway.example'" in error(
            await client.get("/v1/models", headers={"host": "gateway.example"}), 421)


async def test_a_gateway_bound_to_one_address_answers_to_that_address_only_either_way() -> None:
    async with await lan_client("203.0.113.5:8080", favours_this_machine=False) as client:
        r = await client.get("/v1/models", headers={"host": "gateway.example"})
        assert r.status_code == 421


async def test_the_lifespan_of_a_served_app_still_runs() -> None:
    started = trio.Event()

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        started.set()
        yield

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve_asgi(
            Starlette(lifespan=lifespan), "127.0.0.1:0", what="test app", section="test",
            config_path="kvasird.toml", allowed_hosts=(), task_status=task_status))
        with trio.fail_after(5):
            await started.wait()
        nursery.cancel_scope.cancel()


async def test_a_websocket_from_a_foreign_page_is_closed_before_the_app_sees_it() -> None:
    seen: list[Scope] = []
    sent: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope)

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/", "headers": [(b"host", b"127.0.0.1:8080"),
                                                           (b"origin", b"https://evil.example")]}
    await HostGuard(app, "127.0.0.1:8080", (), what="gateway", hint="x")(scope, receive, send)
    assert seen == [] and sent == [{"type": "websocket.close", "code": 1008}]


# --- content type -------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{"content-type": "text/plain"},
                                     {"content-type": "multipart/form-data; boundary=x"},
                                     {"content-type": "application/jsonx"}])
async def test_a_body_not_declared_json_is_a_415(gateway: httpx.AsyncClient,
                                                 headers: dict[str, str]) -> None:
    r = await gateway.post(CHAT, content=json.dumps(HI).encode(), headers=headers)
    assert "Content-Type: application/json" in error(r, 415)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.kvasir+json"])
async def test_json_content_types_with_parameters_or_a_json_suffix_are_read(
        gateway: httpx.AsyncClient, content_type: str) -> None:
    r = await gateway.post(CHAT, content=json.dumps(HI).encode(),
                           headers={"content-type": content_type})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


async def test_the_openai_and_anthropic_sdks_send_what_the_gateway_reads(
        gateway: httpx.AsyncClient) -> None:
    url = str(gateway.base_url).rstrip("/")

    def through_sdks() -> tuple[int, int]:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as oa, \
                anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as an:
            with pytest.raises(openai.APIStatusError) as oa_error:
                oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
            with pytest.raises(anthropic.APIStatusError) as an_error:
                an.messages.create(model="m", max_tokens=4,
                                   messages=[{"role": "user", "content": "Hi"}])
            return oa_error.value.status_code, an_error.value.status_code

    assert await trio.to_thread.run_sync(through_sdks) == (503, 503)


# --- nesting depth ------------------------------------------------------------------------

def nested(depth: int) -> bytes:
    return ('{"model": "m", "deep": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}").encode()


async def test_a_very_deep_body_is_a_quick_400(gateway: httpx.AsyncClient) -> None:
    began = time.monotonic()
    r = await gateway.post(CHAT, content=nested(300_000), headers=JSON)
    assert "nested deeper than 400 levels" in error(r, 400)
    assert time.monotonic() - began < 2.0


async def test_a_top_level_array_nested_past_the_limit_is_a_400(
        gateway: httpx.AsyncClient) -> None:
    r = await gateway.post(CHAT, content=b"[" * 100_000 + b"]" * 100_000, headers=JSON)
    assert "nested deeper than 400 levels" in error(r, 400)


async def test_400_levels_are_read(gateway: httpx.AsyncClient) -> None:
    r = await gateway.post(CHAT, content=nested(400), headers=JSON)
    assert r.status_code == 503, r.text
    assert "nested deeper" in error(await gateway.post(CHAT, content=nested(401), headers=JSON),
                                    400)


async def test_brackets_inside_strings_are_not_nesting(gateway: httpx.AsyncClient) -> None:
    body = json.dumps({**HI, "note": "[{" * 1000 + '\\"' + "[" * 1000})
    assert (await gateway.post(CHAT, content=body.encode(), headers=JSON)).status_code == 503


# --- loopback -----------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost",
                                  "LOCALHOST", "::ffff:127.0.0.1", "[::ffff:127.0.0.2]"])
def test_loopback_addresses_and_names_are_loopback(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["198.51.100.1", "::ffff:198.51.100.1", "0.0.0.0", "::", "", "junk",
                                  "127.0.0.1.5", "[::1", "::1]", "localhost.evil.example",
                                  "2001:db8::1"])
def test_other_addresses_and_junk_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


# --- config -------------------------------------------------------------------------------

def test_allowed_hosts_are_empty_by_default_and_take_names_and_addresses() -> None:
    default = load_text("")
    assert default.gateway.allowed_hosts == () and default.admin.allowed_hosts == ()
    config = load_text('[gateway]\nallowed_hosts = ["kvasir.lan", "203.0.113.5", "[fe80::1]"]\n'
                       '[admin]\nallowed_hosts = ["my-box"]\n')
    assert config.gateway.allowed_hosts == ("kvasir.lan", "203.0.113.5", "[fe80::1]")
    assert config.admin.allowed_hosts == ("my-box",)


@pytest.mark.parametrize("value", ["kvasir.lan:8080", "http://kvasir.lan", "*", "a b"])
def test_an_allowed_host_that_is_not_a_bare_name_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="gateway.allowed_hosts"):
        load_text(f'[gateway]\nallowed_hosts = ["{value}"]\n')
