"""The admin API's POST /v0/generate keeps the gateway's caps and never serves paid work free.

A real InferenceService (its P2P node built, not started) with no model: a request that
passes every check reaches its SwarmGenerator and ends as a 404 UnknownModel there.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from kvasird.admin import generate
from kvasird.config import Config, GatewayConfig, P2PConfig
from kvasird.config.schema import SettlementSection
from kvasird.identity import create_node_key
from kvasird.inference.service import InferenceService
from kvasird.market.records import Capabilities
from kvasird.market.service import MarketService
from kvasird.p2p import P2PNode

LIMITS = GatewayConfig(max_body_bytes=4096, max_prompt_tokens=8, max_tokens=16)
JSON = {"content-type": "application/json"}
LOCAL = "127.0.0.1"
FREE = SettlementSection()
PAID = SettlementSection(enabled=True, free_local=False)
FREE_LOCAL = SettlementSection(enabled=True, free_local=True)


@asynccontextmanager
async def admin(tmp_path: Path, client: str = LOCAL,
                settlement: SettlementSection = FREE
                ) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the admin API's inference routes, calling from address ``client``."""
    config = Config().replace(
        p2p=P2PConfig(listen=("/ip4/127.0.0.1/tcp/0",), dht=False, mdns=False), gateway=LIMITS,
        settlement=settlement)
    p2p = P2PNode(create_node_key(tmp_path / f"{client}.key"), config.p2p, "admintest",
                  sqlite3.connect(":memory:"))
    service = InferenceService(p2p, MarketService(p2p, config.market, None, Capabilities()),
                               config)
    transport = httpx.ASGITransport(app=Starlette(routes=generate.routes(service)),
                                    client=(client, 4242))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:5101") as c:
        yield c


def refused(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["kind"] == kind
    return str(body["error"])


def reached_the_generator(r: httpx.Response) -> bool:
    return r.status_code == 404 and r.json()["kind"] == "UnknownModel"


async def test_a_request_within_the_caps_reaches_the_generator(tmp_path: Path) -> None:
    async with admin(tmp_path) as c:
        assert reached_the_generator(await c.post("/v0/generate",
                                                  json={"prompt": [1, 2], "max_tokens": 16}))


async def test_max_tokens_over_the_gateway_cap_is_a_400_naming_the_key(tmp_path: Path) -> None:
    async with admin(tmp_path) as c:
        r = await c.post("/v0/generate", json={"prompt": [1], "max_tokens": 17})
    assert "[gateway] max_tokens" in refused(r, 400, "BadRequest")


async def test_a_prompt_over_the_gateway_cap_is_a_400_naming_the_key(tmp_path: Path) -> None:
    async with admin(tmp_path) as c:
        r = await c.post("/v0/generate", json={"prompt": list(range(9))})
    assert "[gateway] max_prompt_tokens" in refused(r, 400, "BadRequest")


async def test_a_prompt_that_is_not_token_ids_is_a_400_naming_it(tmp_path: Path) -> None:
    async with admin(tmp_path) as c:
        for prompt in ("hello", [1, "2"], [1, -1], [True]):
            r = await c.post("/v0/generate", json={"prompt": prompt})
            assert "`prompt`" in refused(r, 400, "BadRequest")


async def test_a_body_over_max_body_bytes_is_a_413(tmp_path: Path) -> None:
    async with admin(tmp_path) as c:
        r = await c.post("/v0/generate", json={"prompt": [1], "pad": "x" * 5000})
    assert "[gateway] max_body_bytes" in refused(r, 413, "BodyTooLarge")


async def test_a_body_not_declared_json_is_a_415(tmp_path: Path) -> None:
    async with admin(tmp_path) as c:
        r = await c.post("/v0/generate", content=json.dumps({"prompt": [1]}).encode(),
                         headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in refused(r, 415, "UnsupportedMediaType")


async def test_a_deeply_nested_body_is_a_400(tmp_path: Path) -> None:
    async with admin(tmp_path) as c:
        r = await c.post("/v0/generate", content=b"[" * 1000 + b"]" * 1000, headers=JSON)
    assert "nested deeper than 400 levels" in refused(r, 400, "BadRequest")


async def test_with_payments_and_no_free_local_it_points_to_the_paid_gateway(
        tmp_path: Path) -> None:
    async with admin(tmp_path, settlement=PAID) as c:
        r = await c.post("/v0/generate", json={"prompt": [1]})
    message = refused(r, 402, "PaymentRequired")
    assert "POST /v1/kvasir/quote" in message and "X-Kvasir-Payment" in message


async def test_with_free_local_a_caller_from_elsewhere_is_refused(tmp_path: Path) -> None:
    async with admin(tmp_path, "192.0.2.7", FREE_LOCAL) as c:
        r = await c.post("/v0/generate", json={"prompt": [1]})
    assert "192.0.2.7" in refused(r, 403, "Forbidden")


async def test_with_free_local_callers_on_this_machine_are_served(tmp_path: Path) -> None:
    for client in (LOCAL, "::1", "::ffff:127.0.0.1"):
        async with admin(tmp_path, client, FREE_LOCAL) as c:
            assert reached_the_generator(await c.post("/v0/generate", json={"prompt": [1]}))


@pytest.mark.parametrize("header", ["X-Forwarded-For", "Forwarded", "X-Real-IP",
                                    "X-Forwarded-Host"])
async def test_with_free_local_a_request_a_proxy_relays_from_this_machine_is_refused(
        tmp_path: Path, header: str) -> None:
    async with admin(tmp_path, LOCAL, FREE_LOCAL) as c:
        r = await c.post("/v0/generate", json={"prompt": [1]}, headers={header: "203.0.113.9"})
    assert f"a client relayed by a proxy ({header.lower()})" in refused(r, 403, "Forbidden")
