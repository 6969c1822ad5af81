"""The admin API's inference routes, served from this node's InferenceService:

    POST /v0/generate   token ids in, an NDJSON stream of tokens out, ending in the finish
                        (``kvasird generate`` tokenizes; the gateway's caps apply, and with
                        payments on only the operator on this machine is served, paid like
                        the gateway's own requests)
    GET  /v0/inference  what the data plane does now: serving, generations, routes, unfit

The HTTP lives here, with the API that serves it; the service speaks token ids only.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvasird.config import GatewayConfig
from kvasird.gateway.body import Fields, read_json
from kvasird.gateway.errors import ApiError, BadRequest, Forbidden, PaymentRequired
from kvasird.gateway.openai import top_p
from kvasird.http import operator_request, relay_header
from kvasird.inference.api import (
    Busy,
    Finished,
    GenerationError,
    GenerationRequest,
    NoRoute,
    Sampling,
    SamplingParams,
    TokenEvent,
    UnknownModel,
)
from kvasird.inference.protocol.stage import MAX_TOP
from kvasird.inference.service import InferenceService
from kvasird.settlement.rewards import MeasuredWork

STATUS = {NoRoute: 503, Busy: 429, UnknownModel: 404}
"""The HTTP status of a generation that fails before its first token."""


def routes(inference: InferenceService) -> list[Route]:
    api = InferenceApi(inference)
    return [
        Route("/v0/generate", api.generate, methods=["POST"]),
        Route("/v0/inference", api.status),
    ]


class InferenceApi:
    """The routes' handlers, on ``inference``."""

    def __init__(self, inference: InferenceService) -> None:
        self.inference = inference

    async def status(self, _: Request) -> JSONResponse:
        return JSONResponse(self.inference.status())

    async def generate(self, request: Request) -> Response:
        """Generations for the operator on this machine (``kvasird generate``), within the
        gateway's caps. With payments on, the operator's own requests (operator_request) are
        served only when [settlement] free_local is in effect, and paid to the peers from its
        wallet like the gateway's own (``own_use``); anyone else is sent to the gateway's
        paid API."""
        config, generator = self.inference.config, self.inference.generator
        settlement, client = config.settlement, request.client.host if request.client else ""
        pay = (
            "use the gateway's paid API: POST /v1/kvasir/quote on the gateway, pay the quote, "
            "then send the request to the gateway with X-Kvasir-Payment: "
            "<request_id>:<transaction signature>"
        )
        try:
            if settlement.enabled and not config.free_local_in_effect():
                raise PaymentRequired(
                    "this node takes KVR payments ([settlement] free_local is "
                    'off; "auto" is off while [gateway] listen is not '
                    f"loopback) and the admin API takes none: {pay}"
                )
            if settlement.enabled and not operator_request(request.scope):
                relayed = relay_header(request.scope)
                who = (
                    f"a client relayed by a proxy ({relayed})"
                    if relayed
                    else client or "an unknown client"
                )
                raise Forbidden(
                    "the admin API generates for callers on this machine only, not "
                    f"for {who}: {pay}"
                )
            req = parse_request(
                await read_json(request, config.gateway.max_body_bytes), config.gateway
            )
            own = self.inference.own_use
            charge = (
                await own.charge(len(req.prompt), req.sampling.max_tokens)
                if own is not None
                else None
            )
        except ApiError as exc:
            return JSONResponse(
                {"error": str(exc), "kind": type(exc).__name__}, status_code=exc.status
            )
        produced = 0

        def settle() -> None:  # the peers are paid for it like for the gateway's requests
            if own is not None:
                work = [
                    MeasuredWork(w.peer, w.units, w.ms_per_token)
                    for w in generator.work(req.request_id)
                ]
                own.settle(charge, work, len(req.prompt) if produced else 0, produced)

        events = generator.generate(req)
        try:
            first = await events.__anext__()
        except GenerationError as exc:
            settle()
            return JSONResponse(
                {"error": str(exc), "kind": type(exc).__name__},
                status_code=STATUS.get(type(exc), 500),
            )

        async def lines() -> AsyncIterator[bytes]:
            nonlocal produced
            try:
                produced += isinstance(first, TokenEvent)
                yield _line(first)
                async for event in events:
                    produced += isinstance(event, TokenEvent)
                    yield _line(event)
            except GenerationError as exc:
                yield (json.dumps({"error": str(exc), "kind": type(exc).__name__}) + "\n").encode()
            finally:
                if isinstance(events, AsyncGenerator):
                    await events.aclose()
                settle()

        return StreamingResponse(lines(), media_type="application/x-ndjson")


def parse_request(body: Fields, caps: GatewayConfig) -> GenerationRequest:
    """The admin API's generate body: token ids in (the CLI tokenizes); no prompt longer and
    no max_tokens larger than the gateway would take."""
    prompt = _token_ids(body, "prompt", None)
    if 0 < caps.max_prompt_tokens < len(prompt):
        raise BadRequest(
            f"the prompt is {len(prompt)} tokens, over this node's limit "
            f"([gateway] max_prompt_tokens): {caps.max_prompt_tokens}",
            "prompt",
        )
    max_tokens = body.integer("max_tokens", min(32, caps.max_tokens), 1)
    if max_tokens > caps.max_tokens:
        raise BadRequest(
            f"`max_tokens` = {max_tokens} exceeds this node's limit of "
            f"{caps.max_tokens} ([gateway] max_tokens)",
            "max_tokens",
        )
    params = SamplingParams(
        temperature=body.number("temperature", 0.0, 0),
        top_p=top_p(body),
        top_k=body.integer("top_k", 0, 0),
        min_p=body.number("min_p", 0.0, 0, 1),
        repetition_penalty=body.number("repetition_penalty", 1.0, 0.01),
        seed=body.integer("seed", None, 0, (1 << 64) - 1),
    )
    sampling = Sampling(params, max_tokens, body.integer("logprobs", 0, 0, MAX_TOP))
    return GenerationRequest(
        body.string("model", ""),
        tuple(prompt),
        sampling,
        frozenset(_token_ids(body, "stop", [])),
        body.string("request_id", "") or secrets.token_hex(8),
    )


def _token_ids(body: Fields, name: str, default: list[int] | None) -> list[int]:
    """The array field ``name`` if it holds token ids only (``default`` None: required)."""
    ids: list[int] = body.array(name) if default is None else body.array(name, default)
    if not all(type(t) is int and t >= 0 for t in ids):
        raise BadRequest(f"`{name}` must be an array of token ids (integers >= 0)", name)
    return ids


def _line(event: TokenEvent | Finished) -> bytes:
    if isinstance(event, TokenEvent):
        d: dict[str, Any] = {"token": event.token}
        if event.logprob is not None:
            d.update(logprob=event.logprob, top=[list(t) for t in event.top])
    else:
        d = {
            "finished": event.reason,
            "prompt_tokens": event.prompt_tokens,
            "completion_tokens": event.completion_tokens,
        }
    return (json.dumps(d) + "\n").encode()
