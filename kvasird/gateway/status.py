"""/health and /status (JSON): what the gateway and its node look like now.

/health is what a load balancer or systemd polls: 200 only when a request for the model
would be served now, else 503, with one of the states of ``Gateway.health`` and its
reason; it leaks nothing else. /status is the snapshot the dashboard (dashboard.py)
renders and its script polls: the gateway's counters and chart series, the route a
request would take now and the routes generations ran on lately, and, on a node, its
peers and what each holds, coverage, earnings, the price band and shard downloads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvasird.gateway import payment
from kvasird.gateway.service import Gateway, Routing

if TYPE_CHECKING:
    from kvasird.p2p.peers import PeerInfo

NODE_KEYS = (
    "peer_id",
    "network",
    "join_addr",
    "peers",
    "uptime_s",
    "version",
    "protocol",
    "earnings",
)
COVERAGE_KEYS = (
    "state",
    "held",
    "held_bytes",
    "budget_bytes",
    "model",
    "segments",
    "fully_covered",
    "routable",
    "holders",
)


@dataclass(frozen=True)
class NodeView:
    """What the node a gateway runs on shows of itself, read anew on each call; the daemon
    builds it, so that the gateway (and the admin API) never hold the node itself."""

    status: Callable[[], dict[str, Any]]
    """The node's own status (peer id, network, addresses, uptime, version, earnings)."""
    peers: Callable[[], list[PeerInfo]]
    """The connected peers, oldest connection first."""
    coverage: Callable[[], dict[str, Any]]
    """The market's view of the model: who holds which units, whether a route exists."""
    shards: Callable[[], dict[str, Any]]
    """The shard store and its downloads."""
    earnings: Callable[[], dict[str, Any]]
    """Earnings, receipts and what is owed (``{"enabled": False}`` with settlement off)."""
    checks: Callable[[], dict[str, Any]]
    """What this node's spot checks saw."""
    serving: Callable[[], dict[str, Any]] = dict
    """What this node serves as a stage of routes: ``sessions`` (the generations whose KV
    cache it holds) and its other counters ({} from a view that shows none: /metrics then
    reports no sessions)."""


def health(gw: Gateway) -> tuple[int, dict[str, str]]:
    h = gw.health()
    return (200 if h.status == "ok" else 503), {"status": h.status, "reason": h.reason}


def snapshot(gw: Gateway) -> dict[str, Any]:
    h = gw.health()
    route, missing = gw.route_now()
    if isinstance(gw.generator, Routing):
        gw.stats.saw_routes([p.route for p in list(gw.generator.active.values())])
    out: dict[str, Any] = {
        "ready": h.status == "ok",
        "health": {"status": h.status, "reason": h.reason},
        "gateway": {
            "url": gw.url,
            **gw.stats.snapshot(),
            "series": gw.stats.series(),
            "routes": gw.stats.recent_routes(),
            "route_now": [asdict(hop) for hop in route.hops] if route else None,
            "missing": missing or None,
        },
        "models": [
            {"id": m.model_id, "label": m.label, "context_length": m.context_length}
            for m in gw.models()
        ],
        "price": price(gw),
    }
    node = gw.node
    if node is not None:
        status = node.status()
        out["node"] = {k: status[k] for k in NODE_KEYS if k in status}
        out["peers"] = [{**p.to_json(), "rtt_ms": _round(p.rtt_ms)} for p in node.peers()]
        cov = node.coverage()
        out["coverage"] = {k: cov.get(k) for k in COVERAGE_KEYS}
        out["claims"] = {
            k: v
            for k, v in node.earnings().items()
            if k in ("enabled", "gateways", "pending", "owed_to_peers", "own_use")
        }
        out["shards"] = node.shards()
        out["checks"] = node.checks()
    return out


def price(gw: Gateway) -> dict[str, int] | None:
    """The prices per 1000 output and input tokens and the band governance keeps them in
    (None: requests are free here)."""
    s = payment.settlement_of(gw)
    if s is None:
        return None
    params = s.governance.params()
    return {
        "per_1k_tokens": s.prices.price,
        "per_1k_output_tokens": s.prices.price,
        "per_1k_input_tokens": s.prices.input_price,
        "floor": params.floor,
        "ceiling": params.ceiling,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
