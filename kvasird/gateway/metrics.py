"""GET /metrics: the node in Prometheus's text format, for its operator's scrape.

A hobbyist who runs kvasird as a service and wants graphs runs Prometheus (or Grafana
Agent, netdata...) on the same machine and points it at http://127.0.0.1:8080/metrics. So
the endpoint is on by default and answers this machine's requests only (``[gateway] metrics
= "local"``, decided as kvasird.http.operator_request decides it): a gateway exposed to the
world does not show the world its earnings and traffic. ``"any"`` lets every client that
reaches the gateway read it (a Prometheus elsewhere on a home network), ``"off"`` removes
it. llama-server serves the same path only when started with ``--metrics``: it cannot tell
its operator's scrape from anyone else's, so for it the choice is all or nothing.

Nothing is counted twice: a scrape reads what the gateway counts anyway (gateway.stats:
requests, tokens, time to first token, gaps between tokens, generations waiting and in
flight), the node's views (status.NodeView: peers, coverage, sessions served, earnings in
KVR base units) and the process (CPU, memory, open files).

The text is written by prometheus-client, the official Python client, not by hand: it
escapes label values and help text, answers a scraper that asks for OpenMetrics in that
format, and its process collector reads /proc as every exporter does. Our numbers become
its metric families at scrape time (Collector), so none of its metric objects holds state,
and each gateway has a registry of its own (never the library's global one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvasird import __version__
from kvasird.gateway.errors import Forbidden, NotFound
from kvasird.gateway.stats import GatewayStats, Histogram
from kvasird.http import operator_request

if TYPE_CHECKING:
    from kvasird.gateway.service import Gateway
    from kvasird.gateway.status import NodeView

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods counted by name; any other a client invents counts as "other"."""
UNROUTED = "other"
"""The route label of requests that reached no route: 404s (whose path a client chooses,
so it never becomes a label) and CORS preflights, which are answered before routing."""


def scraper(gw: Gateway) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint of GET /metrics for ``gw`` (its registry is built once, here)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(gw))
    ProcessCollector(registry=registry)

    async def scrape(request: Request) -> Response:
        _check_access(gw.config.metrics, request)
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(
            encode(registry),
            headers={"Content-Type": content_type, "Cache-Control": "no-store"},
        )

    return scrape


def _check_access(policy: str, request: Request) -> None:
    if policy == "off":
        raise NotFound(
            'the metrics endpoint is off on this gateway ([gateway] metrics = "off" in '
            'the node\'s kvasird.toml): set it to "local" to let this machine scrape it'
        )
    if policy == "local" and not operator_request(request.scope):
        raise Forbidden(
            "/metrics answers scrapes from this gateway's own machine only ([gateway] "
            'metrics = "local"): scrape it from there, or set [gateway] metrics = "any" '
            "in the node's kvasird.toml to let every client that reaches the gateway read it"
        )


class Collector:
    """The gateway's and its node's numbers as metric families, read anew at each scrape."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def collect(self) -> Iterator[Metric]:
        gw = self._gw
        models = gw.models()
        yield _gauge(
            "kvasird_info",
            "This node's version and the model its gateway serves (the value is always 1).",
            {"version": __version__, "model": models[0].label if models else ""},
            1,
        )
        yield _gauge("kvasird_gateway_ready", "1 when /health says ok.", {}, int(gw.ready))
        yield from _gateway(gw.stats, gw.config.max_concurrent)
        if gw.node is not None:
            yield from _node(gw.node)


def _gateway(stats: GatewayStats, limit: int) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "kvasird_http_requests",
        "HTTP requests the gateway answered, by route (its path template), method and status.",
        labels=("route", "method", "status"),
    )
    for (route, method, status), n in sorted(stats.requests.items()):
        requests.add_metric((route, method, str(status)), n)
    yield requests
    generations = CounterMetricFamily(
        "kvasird_generations",
        "Generations ended, by the status they ended with: 200 served, 429 refused at the "
        "concurrency limit, 499 left by their client, others failed (a stream that failed "
        "after its first token counts its error here, not in kvasird_http_requests).",
        labels=("status",),
    )
    for status, n in sorted(stats.by_status.items()):
        generations.add_metric((str(status),), n)
    yield generations
    yield CounterMetricFamily(
        "kvasird_prompt_tokens",
        "Prompt tokens of the generations served (once per request, whatever its `n`).",
        value=stats.prompt_tokens,
    )
    yield CounterMetricFamily(
        "kvasird_generated_tokens", "Tokens generated for served requests.", value=stats.tokens
    )
    yield _histogram(
        "kvasird_time_to_first_token_seconds",
        "Seconds from a generation's admission to its first token.",
        stats.ttft,
    )
    yield _histogram(
        "kvasird_token_gap_seconds",
        "Seconds between a choice's successive tokens as the gateway hands them on.",
        stats.gaps,
    )
    yield _gauge(
        "kvasird_generations_in_flight",
        "Generations admitted and not yet ended (waiting ones included).",
        {},
        stats.in_flight,
    )
    yield _gauge(
        "kvasird_generations_waiting",
        "Generations admitted that have no token yet: waiting for a route, KV room or "
        "their prompt's computation.",
        {},
        stats.waiting,
    )
    yield _gauge(
        "kvasird_generations_limit",
        "Generations in flight at once past which requests get 429 ([gateway] max_concurrent).",
        {},
        limit,
    )


def _node(node: NodeView) -> Iterator[Metric]:
    yield _gauge(
        "kvasird_peers_connected", "Peers this node is connected to.", {}, len(node.peers())
    )
    known = GaugeMetricFamily(
        "kvasird_peers_known",
        "Nodes whose coverage records this node holds, by the state they announce.",
        labels=("state",),
    )
    holders: dict[str, Any] = node.coverage().get("holders") or {}
    for state, n in sorted(Counter(h["state"] for h in holders.values()).items()):
        known.add_metric((state,), n)
    yield known
    yield _gauge(
        "kvasird_stage_sessions",
        "Generations whose KV cache this node holds as a stage of their route.",
        {},
        node.serving().get("sessions", 0),
    )
    yield from _earnings(node.earnings())


def _earnings(summary: dict[str, Any]) -> Iterator[Metric]:
    """In KVR base units; nothing while settlement is off (no money moves)."""
    if not summary.get("enabled"):
        return
    gateways = summary["gateways"]
    yield CounterMetricFamily(
        "kvasird_earned_kvr_base_units",
        "What receipts of the gateways this node worked for say it earned.",
        value=sum(g["earned"] for g in gateways),
    )
    yield CounterMetricFamily(
        "kvasird_received_kvr_base_units",
        "What those gateways paid this node out on chain.",
        value=sum(g["received"] for g in gateways),
    )
    yield _gauge(
        "kvasird_pending_kvr_base_units",
        "Earned and not yet paid out (`kvasird wallet claim` claims it).",
        {},
        summary["pending"],
    )
    if "owed_to_peers" in summary:
        owed = sum(p["earned"] - p["paid"] for p in summary["owed_to_peers"])
        yield _gauge(
            "kvasird_owed_to_peers_kvr_base_units",
            "As a gateway: what the peers that worked for it earned and were not paid yet.",
            {},
            owed,
        )


def _gauge(name: str, help_: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, help_, labels=tuple(labels))
    gauge.add_metric(tuple(labels.values()), value)
    return gauge


def _histogram(name: str, help_: str, h: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(
        name,
        help_,
        buckets=[(floatToGoString(bound), n) for bound, n in h.cumulative()],
        sum_value=h.sum,
    )


class CountRequests:
    """ASGI middleware that counts each request once it is answered (GatewayStats.answered)
    by its route's path template, never by its path: a client chooses a 404's path, and
    labels it chose would grow the scrape without bound. A request whose answer never
    started (the client left) counts as 499, one that raised as 500. What the Host guard
    refused (kvasird.http.HostGuard: 421, 403) never reached the app and is not counted."""

    def __init__(self, app: ASGIApp, stats: GatewayStats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def noting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting)
        except Exception:
            status = status or 500
            raise
        finally:
            route = getattr(scope.get("route"), "path", UNROUTED)
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.stats.answered(route, method, status or 499)
