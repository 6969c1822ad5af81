"""Routes of the admin API. Handlers only read snapshots of the node's state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from kvasird.daemon.node import Node


def build_app(node: Node) -> Starlette:
    async def status(_: Request) -> JSONResponse:
        return JSONResponse(node.status())

    async def peers(_: Request) -> JSONResponse:
        return JSONResponse([p.to_json() for p in node.p2p.peers.snapshot()])

    async def coverage(_: Request) -> JSONResponse:
        return JSONResponse(node.market.coverage())

    async def shards(_: Request) -> JSONResponse:
        return JSONResponse(node.shards.view())

    async def settlement(_: Request) -> JSONResponse:
        s = node.settlement
        if s is None:
            return JSONResponse({"enabled": False})
        return JSONResponse({"enabled": True, "params": s.governance.params().to_wire(),
                             "price_per_1k_tokens": s.prices.price})

    return Starlette(routes=[
        Route("/v0/settlement", settlement),
        Route("/v0/shards", shards),
        Route("/v0/status", status),
        Route("/v0/peers", peers),
        Route("/v0/coverage", coverage),
    ])
