"""The Starlette app: routes bound to one Gateway, and errors in each API's own shape.

Cross-origin reads (CORS) are off unless [gateway] cors_origins names the web pages
that may make them; those get preflight answers (204), Access-Control-Allow-* headers, and
may read the payment and x-kvasir-* response headers (EXPOSED).
A preflight from any other page is refused (403) with the key to set, never left to the
routes, which answer OPTIONS with 405. Every request is counted for /metrics
(metrics.CountRequests).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvasird.gateway import (
    anthropic,
    dashboard,
    embeddings,
    metrics,
    openai,
    ops,
    payment,
    responses,
    status,
    x402,
)
from kvasird.gateway.body import read_json
from kvasird.gateway.errors import ApiError, BadRequest, Forbidden, NotFound
from kvasird.gateway.service import Gateway
from kvasird.logs import get_logger

log = get_logger("kvasird.gateway")

Handler = Callable[[Gateway, Request], Awaitable[Any]]


QUOTED = {
    "messages": openai.chat_completions,
    "prompt": openai.completions,
    "input": responses.create,
    "anthropic": anthropic.messages,
}
"""A quote's body that is a request: the key that tells its API -> that API's parser."""

PAID = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings"}
)
"""The paths whose requests are paid for: one refused before it ran keeps its payment."""
PREFLIGHT_MAX_AGE_S = 600
"""How long a browser may reuse a granted preflight."""
EXPOSED = (
    x402.REQUIRED.decode(),
    x402.RESPONSE.decode(),
    "x-kvasir-paid-by",
    "x-kvasir-max-cost",
    "x-kvasir-max-tokens",
    "x-kvasir-reasoning",
    "x-kvasir-pooling",
)
"""Response headers of ours a page of an allowed origin may read (a browser hides all but
a few standard ones): an x402 client's payment requirements and receipt, and what a
request was charged, granted and computed with."""


def build_app(gw: Gateway) -> Starlette:
    def bind(handler: Handler) -> Callable[[Request], Awaitable[Any]]:
        async def endpoint(request: Request) -> Any:
            return await handler(gw, request)

        return endpoint

    async def health(_: Request) -> JSONResponse:
        code, body = status.health(gw)
        return JSONResponse(body, status_code=code)

    async def status_json(_: Request) -> JSONResponse:
        return JSONResponse(status.snapshot(gw))

    async def quote(request: Request) -> JSONResponse:
        """A quote for P prompt tokens and N output tokens (n choices), or for the very
        request to be paid, posted as it will be sent: its prompt counted by this gateway's
        tokenizer and template (an Anthropic body with ?api=anthropic)."""
        f = await read_json(request, gw.config.max_body_bytes)
        client = request.client.host if request.client else "an unknown address"
        parse = QUOTED.get(
            "anthropic"
            if request.query_params.get("api") == "anthropic"
            else next((k for k in QUOTED if f.has(k)), "")
        )
        if parse is not None:
            job = (await parse(gw, request)).job
            n, max_tokens, prompts = job.n, job.request.sampling.max_tokens, job.prompt_positions
        else:
            max_tokens = min(f.integer("max_tokens", gw.config.max_tokens, 1), gw.context())
            n = gw.choices(f.integer("n", 1))
            prompts = n * f.integer("prompt_tokens", 0, 0, 10_000_000)
        return JSONResponse(payment.quote(gw, n * max_tokens, client, prompts))

    async def balance(request: Request) -> JSONResponse:
        return JSONResponse(payment.prepaid(gw, request.path_params["wallet"]))

    async def api_error(request: Request, exc: Exception) -> Response:
        """An API error; a paid request's (refused before its payment was taken: an unknown
        model, a bad field, a gateway not ready) says that the payment stays usable."""
        assert isinstance(exc, ApiError)
        header = request.headers.get(payment.HEADER.decode())
        if header is not None and request.url.path in PAID:
            exc.message += await payment.unused(gw, header.encode())
        return _render(request, exc)

    async def status_page(_: Request) -> HTMLResponse:
        return HTMLResponse(
            dashboard.page(status.snapshot(gw)), headers={"Cache-Control": "no-store"}
        )

    routes = [
        Route("/v1/chat/completions", bind(openai.chat_completions), methods=["POST"]),
        Route("/v1/completions", bind(openai.completions), methods=["POST"]),
        Route("/v1/embeddings", bind(embeddings.create), methods=["POST"]),
        Route("/v1/models", bind(openai.models), methods=["GET"]),
        Route("/v1/models/{model:path}", bind(openai.model), methods=["GET"]),
        Route("/v1/responses", bind(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", bind(responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", bind(responses.delete), methods=["DELETE"]),
        Route("/v1/messages", bind(anthropic.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", bind(anthropic.count_tokens), methods=["POST"]),
        Route("/v1/kvasir/quote", quote, methods=["POST"]),
        Route("/v1/kvasir/balance/{wallet}", balance, methods=["GET"]),
        Route("/tokenize", bind(ops.tokenize), methods=["POST"]),
        Route("/detokenize", bind(ops.detokenize), methods=["POST"]),
        Route("/apply-template", bind(ops.apply_template), methods=["POST"]),
        Route("/props", bind(ops.props), methods=["GET"]),
        Route("/metrics", metrics.scraper(gw), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/status", status_json, methods=["GET"]),
        Route("/", status_page, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(metrics.CountRequests, stats=gw.stats),
            Middleware(
                Cors,
                origins=gw.config.cors_origins,
                methods=sorted({m for r in routes for m in r.methods or ()} - {"HEAD"}),
            ),
        ],
        exception_handlers={
            ApiError: api_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )


class Cors(CORSMiddleware):
    """CORS for the pages of ``origins`` (none: no CORS headers at all, so browsers keep
    other pages from reading answers). No credentials: the API takes keys in headers.

    A preflight from an allowed page is granted with 204 for any of ``methods`` (those of
    the routes) and whatever headers it asks for (SDKs add their own), and for a gateway
    on a private address when Chrome asks (Private Network Access); one from any other
    page gets 403 and what to configure (Starlette's own answer is a bare 400). An OPTIONS
    request that is no preflight (``curl -X OPTIONS``) gets 204 and the methods in Allow,
    as llama-server answers every OPTIONS, never the routes' 405."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...], methods: list[str]) -> None:
        super().__init__(
            app,
            allow_origins=list(origins),
            allow_methods=methods,
            allow_headers=["*"],
            expose_headers=list(EXPOSED),
            allow_private_network=True,
            max_age=PREFLIGHT_MAX_AGE_S,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            headers = Headers(scope=scope)
            if "origin" not in headers or "access-control-request-method" not in headers:
                allow = ", ".join([*self.allow_methods, "OPTIONS"])
                answer = Response(status_code=204, headers={"Allow": allow})
                await answer(scope, receive, partial(self.send, send=send, request_headers=headers))
                return
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        origin = request_headers["origin"]
        method = request_headers["access-control-request-method"]
        if not self.is_allowed_origin(origin):
            return _refuse_preflight(
                f"the web page at {origin!r} may not call this gateway from a browser "
                f"(CORS): to let it, add {origin!r} to [gateway] cors_origins in the "
                "node's kvasird.toml"
            )
        if method not in self.allow_methods:
            return _refuse_preflight(
                f"no endpoint of this gateway takes {method!r} requests; they take "
                + ", ".join(self.allow_methods)
            )
        headers = dict(self.preflight_headers)
        if self.preflight_explicit_allow_origin:
            headers["Access-Control-Allow-Origin"] = origin
        if asked := request_headers.get("access-control-request-headers"):
            headers["Access-Control-Allow-Headers"] = asked
        if request_headers.get("access-control-request-private-network") is not None:
            headers["Access-Control-Allow-Private-Network"] = "true"
        return Response(status_code=204, headers=headers)


def _refuse_preflight(message: str) -> Response:
    return JSONResponse(Forbidden(message).openai(), status_code=403, headers={"Vary": "Origin"})


def _render(request: Request, err: ApiError) -> JSONResponse:
    anthropic_shape = request.url.path.startswith("/v1/messages")
    return JSONResponse(
        err.anthropic() if anthropic_shape else err.openai(), status_code=err.status
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: ApiError = NotFound(f"no such endpoint: {request.method} {request.url.path}")
    else:
        err = BadRequest(f"{request.method} {request.url.path}: {exc.detail}")
        err.status = exc.status_code
    return _render(request, err)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("gateway handler failed", path=request.url.path, error=repr(exc))
    return _render(
        request,
        ApiError(
            "the gateway failed on this request (a bug; see the node's "
            "log); the request may be retried"
        ),
    )
