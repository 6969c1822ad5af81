"""Who a paid gateway serves without a quote: the operator's own requests from this machine,
never one that a proxy says it relays, and nobody by default once the gateway listens on
every address, where it answers to any name (real daemons on the local chain, bound to
0.0.0.0 but sent traffic on 127.0.0.1 only)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from kvasird.localnet import LocalNet, LocalNode
from kvasird.model.bundled import bundled_path
from tests.support import eventually

pytestmark = pytest.mark.slow

READY_S = 120.0
RELAYED = {"X-Forwarded-For": "203.0.113.9", "Forwarded": "for=203.0.113.9",
           "X-Real-IP": "203.0.113.9", "X-Forwarded-Host": "gateway.example"}


@contextmanager
def paid_gateway(root: Path, **settings: Any) -> Iterator[tuple[LocalNode, str]]:
    """A one-node network on the local chain with ``settings``; its node and the URL of its
    gateway on 127.0.0.1 once it serves its model."""
    net = LocalNet(root, 1, chain=True, settings={
        "market.model": str(bundled_path()), "market.memory_budget_mb": 200,
        "market.target_replicas": 1, "market.heartbeat_s": 1.0, "market.enroll_delay_s": 0.0,
        "compute.threads": 1, "gateway.local": True, "gateway.listen": "0.0.0.0:0", **settings})
    try:
        net.up()
        node = net.nodes[0]
        url = f"http://127.0.0.1:{urlsplit(node.status()['gateway']).port}"
        eventually("the gateway is ready",
                   lambda: httpx.get(url + "/health", timeout=5).status_code == 200,
                   timeout=READY_S, every=0.2, context=node.tail)
        yield node, url
    finally:
        net.down()


@pytest.fixture(scope="module")
def free_local(module_tmp: Callable[[str], Path]) -> Iterator[tuple[LocalNode, str]]:
    """free_local set on by hand (a warned-of choice on a gateway listening on 0.0.0.0)."""
    with paid_gateway(module_tmp("free"), **{"settlement.free_local": True}) as g:
        yield g


@pytest.fixture(scope="module")
def public(module_tmp: Callable[[str], Path]) -> Iterator[tuple[LocalNode, str]]:
    """free_local left unset ("auto") on a gateway listening on 0.0.0.0."""
    with paid_gateway(module_tmp("public")) as g:
        yield g


def chat(url: str, **headers: str) -> httpx.Response:
    model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
    return httpx.post(url + "/v1/chat/completions", timeout=60, headers=headers, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})


def test_the_operators_own_request_is_served_without_a_quote(
        free_local: tuple[LocalNode, str]) -> None:
    r = chat(free_local[1])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("header", list(RELAYED))
def test_a_request_a_proxy_on_this_machine_relays_needs_a_quote(
        free_local: tuple[LocalNode, str], header: str) -> None:
    r = chat(free_local[1], **{header: RELAYED[header]})
    assert r.status_code == 402, r.text
    assert "POST /v1/kvasir/quote" in r.text


def events(node: LocalNode) -> list[dict[str, Any]]:
    """The JSON log events of ``node`` (its log is a file, so it logs JSON lines)."""
    lines = node.log.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_free_local_on_a_public_listen_is_warned_of_and_keeps_the_host_check(
        free_local: tuple[LocalNode, str]) -> None:
    node, url = free_local
    said = "[settlement] free_local = true while [gateway] listen = '0.0.0.0:0'"
    logged = events(node)
    assert [e for e in logged if e["level"] == "warning" and e["event"].startswith(said)]
    [banner] = [e for e in logged if e["event"] == "banner"]
    assert [w for w in banner["warnings"] if w.startswith(said)]
    r = httpx.get(url + "/v1/models", headers={"host": "gateway.example"}, timeout=5)
    assert r.status_code == 421 and "[gateway] allowed_hosts" in r.text


def test_on_every_address_any_host_is_answered_and_this_machine_pays_too(
        public: tuple[LocalNode, str]) -> None:
    node, url = public
    host = {"host": "gateway.example"}
    assert httpx.get(url + "/v1/models", headers=host, timeout=5).status_code == 200
    r = chat(url, **host)
    assert r.status_code == 402, r.text
    assert chat(url).status_code == 402
    [banner] = [e for e in events(node) if e["event"] == "banner"]
    assert banner["warnings"] == []
