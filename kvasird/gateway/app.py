"""The Starlette app: routes bound to one Gateway, and errors in each API's own shape.

Cross-origin reads (CORS) are off unless [gateway] cors_origins names the web pages
that may make them; those get preflight answers and Access-Control-Allow-* headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from kvasird.gateway import anthropic, dashboard, openai, payment, responses, status
from kvasird.gateway.body import read_json
from kvasird.gateway.errors import ApiError, BadRequest, NotFound
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

PAID = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
"""The paths whose requests are paid for: one refused before it ran keeps its payment."""


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
            n, max_tokens, prompt = job.n, job.request.sampling.max_tokens, len(job.request.prompt)
        else:
            max_tokens = f.integer("max_tokens", gw.config.max_tokens, 1, gw.config.max_tokens)
            n = gw.choices(f.integer("n", 1))
            prompt = f.integer("prompt_tokens", 0, 0, 10_000_000)
        return JSONResponse(payment.quote(gw, n * max_tokens, client, n * prompt))

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

    return Starlette(
        routes=[
            Route("/v1/chat/completions", bind(openai.chat_completions), methods=["POST"]),
            Route("/v1/completions", bind(openai.completions), methods=["POST"]),
            Route("/v1/models", bind(openai.models), methods=["GET"]),
            Route("/v1/models/{model:path}", bind(openai.model), methods=["GET"]),
            Route("/v1/responses", bind(responses.create), methods=["POST"]),
            Route("/v1/responses/{response_id}", bind(responses.retrieve), methods=["GET"]),
            Route("/v1/messages", bind(anthropic.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", bind(anthropic.count_tokens), methods=["POST"]),
            Route("/v1/kvasir/quote", quote, methods=["POST"]),
            Route("/v1/kvasir/balance/{wallet}", balance, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/status", status_json, methods=["GET"]),
            Route("/", status_page, methods=["GET"]),
        ],
        middleware=_cors(gw.config.cors_origins),
        exception_handlers={
            ApiError: api_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )


def _cors(origins: tuple[str, ...]) -> list[Middleware]:
    """CORS for the pages of ``origins`` (none: no CORS headers at all, so browsers keep
    other pages from reading answers). No credentials: the API takes keys in headers."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            max_age=600,
        )
    ]


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
