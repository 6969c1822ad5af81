"""The admin API's view of the money: what this node earned, is owed, and claims.

GET  /v0/wallet        as a serving peer: receipts per gateway (earned, received, pending),
                       the work it metered for each gateway wallet and what receipts
                       covered; as a gateway: what it owes each peer and the work it
                       measured them do (units before tiers), its pools, receipts
                       delivered, and the operator's own use (requests, base units spent)
POST /v0/wallet/claim  claim from every gateway that owes this node; each payout verified
                       on chain (``kvasird wallet claim``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvasird.errors import KvasirError

if TYPE_CHECKING:
    from kvasird.daemon.node import Node
    from kvasird.settlement.service import Settlement


def summary(node: Node) -> dict[str, Any]:
    """Earnings as the status page, `kvasird status` and `kvasird wallet` show them."""
    s = node.settlement
    if s is None:
        return {"enabled": False}
    gateways = _gateways(s)
    out: dict[str, Any] = {
        "enabled": True,
        "wallet": str(s.wallet.address),
        "gateways": gateways,
        "pending": sum(g["pending"] for g in gateways),
    }
    if s.rewards is not None:
        out["owed_to_peers"] = [peer.to_json() for peer in s.rewards.peers()]
        out["pools"] = {name: s.rewards.pool(name) for name in ("operator", "insurance")}
        requests, spent = s.rewards.own_use()
        out["own_use"] = {"requests": requests, "spent": spent}
        out["receipts_delivered"] = node.exchange.delivered if node.exchange else 0
    if node.admission is not None:
        out["refused_gateways"] = dict(node.admission.refused)
        out["metered"] = {
            str(w): {"metered": a.metered, "receipted": a.receipted}
            for w, a in node.admission.accounts.items()
        }
    return out


def totals(node: Node) -> dict[str, int] | None:
    """Earned, received and pending over every gateway (None with settlement off)."""
    if node.settlement is None:
        return None
    gateways = _gateways(node.settlement)
    return {
        **{k: sum(g[k] for g in gateways) for k in ("earned", "received", "pending")},
        "gateways": len(gateways),
    }


def _gateways(s: Settlement) -> list[dict[str, Any]]:
    """This node's receipts and payouts, per gateway that owes it."""
    return [
        {
            "gateway": str(g),
            "peer_id": p,
            "earned": s.receipts.earned(g),
            "received": s.receipts.received(g),
            "pending": unpaid,
        }
        for g, p, unpaid in s.receipts.gateways()
    ]


def routes(node: Node) -> list[Route]:
    async def wallet(_: Request) -> JSONResponse:
        return JSONResponse(summary(node))

    async def claim(_: Request) -> JSONResponse:
        if node.exchange is None:
            return JSONResponse(
                {
                    "error": "settlement is off on this node ([settlement] "
                    "enabled = false): there is nothing to claim"
                },
                status_code=409,
            )
        try:
            claimed = await node.exchange.claim_all()
        except KvasirError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse({"claims": [c.to_json() for c in claimed]})

    return [
        Route("/v0/wallet", wallet, methods=["GET"]),
        Route("/v0/wallet/claim", claim, methods=["POST"]),
    ]
