"""/health and /status (JSON): what the gateway and its node look like now.

/health is what a load balancer or systemd polls: 200 only when a request for the model
would be served now, else 503, with one of the states of ``Gateway.health`` and its
reason; it leaks nothing else. /status is the snapshot the dashboard (dashboard.py)
renders and its script polls: the gateway's counters and chart series, the route a
request would take now and the routes generations ran on lately, and, on a node, its
peers and what each holds, coverage, earnings, the price band and shard downloads.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvasird.gateway import payment
from kvasird.gateway.service import Gateway, Routing

NODE_KEYS = ("peer_id", "network", "join_addr", "peers", "uptime_s", "version", "protocol",
             "earnings")
COVERAGE_KEYS = ("state", "held", "held_bytes", "budget_bytes", "model", "segments",
                 "fully_covered", "routable", "holders")


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
        "gateway": {"url": gw.url, **gw.stats.snapshot(), "series": gw.stats.series(),
                    "routes": gw.stats.recent_routes(),
                    "route_now": [asdict(hop) for hop in route.hops] if route else None,
                    "missing": missing or None},
        "models": [{"id": m.model_id, "label": m.label, "context_length": m.context_length}
                   for m in gw.models()],
        "price": price(gw),
    }
    node = gw.node
    if node is not None:
        from kvasird.daemon import earnings  # deferred: a gateway may run without a node

        status = node.status()
        out["node"] = {k: status[k] for k in NODE_KEYS if k in status}
        out["peers"] = [{**p.to_json(), "rtt_ms": _round(p.rtt_ms)}
                        for p in node.p2p.peers.snapshot()]
        cov = node.market.coverage()
        out["coverage"] = {k: cov.get(k) for k in COVERAGE_KEYS}
        out["claims"] = {k: v for k, v in earnings.summary(node).items()
                         if k in ("enabled", "gateways", "pending", "owed_to_peers", "own_use")}
        out["shards"] = node.shards.view()
        out["checks"] = node.inference.spot.status()
    return out


def price(gw: Gateway) -> dict[str, int] | None:
    """The prices per 1000 output and input tokens and the band governance keeps them in
    (None: requests are free here)."""
    s = payment.settlement_of(gw)
    if s is None:
        return None
    params = s.governance.params()
    return {"per_1k_tokens": s.prices.price, "per_1k_output_tokens": s.prices.price,
            "per_1k_input_tokens": s.prices.input_price, "floor": params.floor,
            "ceiling": params.ceiling}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
