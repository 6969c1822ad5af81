"""/metrics of a served gateway whose node is a stand-in view: peers, coverage, sessions and
earnings reach the scrape as the node shows them; who may scrape; CORS preflights with no
page configured; the histograms and the gaps between tokens as the gateway counts them.

The gateway is real (hypercorn on a free loopback port) but holds no model, so these are
fast; tests/gateway/test_ops.py scrapes a daemon that generates.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from kvasird.config import GatewayConfig
from kvasird.gateway.service import Gateway
from kvasird.gateway.stats import GatewayStats, Histogram
from kvasird.gateway.status import NodeView
from kvasird.p2p.peers import PeerInfo

EARNINGS = {
    "enabled": True,
    "gateways": [
        {"earned": 700, "received": 200, "pending": 500},
        {"earned": 300, "received": 300, "pending": 0},
    ],
    "pending": 500,
    "owed_to_peers": [{"earned": 90, "paid": 40}, {"earned": 10, "paid": 10}],
}
HOLDERS = {"a": {"state": "online"}, "b": {"state": "online"}, "c": {"state": "draining"}}


def node(earnings: dict[str, Any]) -> NodeView:
    def empty() -> dict[str, Any]:
        return {}

    peer = PeerInfo("12D3KooWPeer", (), 0.0, 0.0, None, "")
    return NodeView(
        status=empty,
        peers=lambda: [peer, peer],
        coverage=lambda: {"holders": HOLDERS},
        shards=empty,
        earnings=lambda: earnings,
        checks=empty,
        serving=lambda: {"sessions": 3},
    )


@asynccontextmanager
async def served(
    config: GatewayConfig, view: NodeView | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    gw = Gateway(config, node=view)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(gw.run)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield client
        nursery.cancel_scope.cancel()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


LOCAL = GatewayConfig(listen="127.0.0.1:0")


async def test_the_nodes_peers_sessions_and_earnings_reach_the_scrape() -> None:
    async with served(LOCAL, node(EARNINGS)) as client:
        r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    got = samples(r.text)
    assert got["kvasird_peers_connected", ()] == 2
    assert got["kvasird_peers_known", (("state", "online"),)] == 2
    assert got["kvasird_peers_known", (("state", "draining"),)] == 1
    assert got["kvasird_stage_sessions", ()] == 3
    assert got["kvasird_earned_kvr_base_units_total", ()] == 1000
    assert got["kvasird_received_kvr_base_units_total", ()] == 500
    assert got["kvasird_pending_kvr_base_units", ()] == 500
    assert got["kvasird_owed_to_peers_kvr_base_units", ()] == 50
    assert got["kvasird_gateway_ready", ()] == 0, "no model: /health is not ok"


async def test_a_node_without_settlement_exports_no_earnings() -> None:
    async with served(LOCAL, node({"enabled": False})) as client:
        text = (await client.get("/metrics")).text
    assert "kvr" not in text and "kvasird_stage_sessions 3.0" in text


async def test_a_scraper_that_asks_for_openmetrics_gets_it() -> None:
    async with served(LOCAL) as client:
        r = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")


RELAYED = {"X-Forwarded-For": "203.0.113.9"}


@pytest.mark.parametrize(
    ("policy", "headers", "status"),
    [("local", {}, 200), ("local", RELAYED, 403), ("any", RELAYED, 200), ("off", {}, 404)],
)
async def test_who_may_scrape_is_the_metrics_key(
    policy: str, headers: dict[str, str], status: int
) -> None:
    async with served(GatewayConfig(listen="127.0.0.1:0", metrics=policy)) as client:
        r = await client.get("/metrics", headers=headers)
    assert r.status_code == status, r.text
    if status != 200:
        assert "[gateway] metrics" in r.json()["error"]["message"]


async def test_with_no_page_configured_a_preflight_is_refused_naming_the_key() -> None:
    async with served(LOCAL) as client:
        r = await client.options(
            "/v1/models",
            headers={"Origin": "http://localhost:5173", "Access-Control-Request-Method": "GET"},
        )
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert "to [gateway] cors_origins" in r.json()["error"]["message"]


async def test_an_options_request_that_is_no_preflight_gets_the_methods_not_a_405() -> None:
    async with served(LOCAL) as client:
        r = await client.options("/v1/chat/completions")
    assert r.status_code == 204
    assert {"GET", "POST", "DELETE", "OPTIONS"} <= set(r.headers["allow"].split(", "))


# --- what the gateway counts --------------------------------------------------------------


def test_a_histogram_counts_each_value_under_the_first_bound_it_does_not_exceed() -> None:
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 2.0):
        h.observe(value)
    h.observe(0.2, 3)
    assert h.cumulative() == [(0.1, 2), (1.0, 6), (math.inf, 7)]
    assert h.sum == pytest.approx(0.05 + 0.1 + 0.5 + 2.0 + 0.6)


def test_a_piece_of_several_tokens_counts_a_gap_for_each_but_a_choices_first() -> None:
    stats = GatewayStats()
    with stats.admit(4) as slot:
        assert (stats.in_flight, stats.waiting) == (1, 1)
        slot.first_token()
        assert stats.waiting == 0 and stats.ttft.cumulative()[-1][1] == 1
        pieces: list[tuple[int, int]] = [(0, 2), (1, 1), (0, 3), (1, 0), (1, 1)]
        for choice, n in pieces:
            slot.tokens(choice, n)
        slot.finish(200, 7, prompt_tokens=11)
    assert stats.gaps.cumulative()[-1][1] == 4, "3 of choice 0's second piece, 1 of choice 1"
    assert (stats.in_flight, stats.prompt_tokens, stats.tokens) == (0, 11, 7)


def test_a_generation_that_never_got_a_token_stops_waiting_when_it_ends() -> None:
    stats = GatewayStats()
    with stats.admit(4) as slot:
        slot.finish(503)
    assert (stats.in_flight, stats.waiting) == (0, 0)
    assert stats.ttft.cumulative()[-1][1] == 0
