"""Errors the gateway answers with: an HTTP status, the offending field, a message to act on.

    KvasirError
    └── ApiError                 rendered in the calling API's own error JSON
        ├── BadRequest           400: a field is missing, of the wrong type or out of range,
        │                        or the body is malformed (not UTF-8 JSON, NaN, a lone surrogate)
        ├── NotFound             404: unknown model or path
        ├── PaymentRequired      402: settlement is on and the request carries no valid payment
        ├── Forbidden            403: the caller may not use this (admin generations: local only)
        ├── BodyTooLarge         413: the body exceeds [gateway] max_body_bytes
        ├── UnsupportedMediaType 415: the body is declared another type than JSON
        ├── TooManyRequests      429: [gateway] max_concurrent reached, or no capacity
        └── Unavailable          503: no route serves the model (yet)

Generation errors from the Generator contract (NoRoute, Busy, UnknownModel, NotServed) become
the matching ApiError through ``from_generation``; any other KvasirError a generator
raises is a 500 that says the request itself was fine.
"""

from __future__ import annotations

from kvasird.errors import KvasirError
from kvasird.inference.api import Busy, NoRoute, NotServed, UnknownModel


class ApiError(KvasirError):
    status = 500
    openai_type = "server_error"
    anthropic_type = "api_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        """The request field at fault (OpenAI's ``param``), when one is."""
        self.code = code
        """A machine-readable reason (OpenAI's ``code``), e.g. "context_length_exceeded"."""
        self.headers: list[tuple[bytes, bytes]] = []
        """Response headers the error is sent with (a 402's x402 PAYMENT-REQUIRED)."""

    def openai(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic(self) -> dict[str, object]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}


class BadRequest(ApiError):
    status = 400
    openai_type = anthropic_type = "invalid_request_error"


class NotFound(ApiError):
    status = 404
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"


class PaymentRequired(ApiError):
    status = 402
    openai_type = "payment_required"
    anthropic_type = "permission_error"


class Forbidden(ApiError):
    status = 403
    openai_type = anthropic_type = "permission_error"


class BodyTooLarge(ApiError):
    status = 413
    openai_type = "invalid_request_error"
    anthropic_type = "request_too_large"


class UnsupportedMediaType(ApiError):
    status = 415
    openai_type = anthropic_type = "invalid_request_error"


class TooManyRequests(ApiError):
    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "rate_limit_error"


class Unavailable(ApiError):
    status = 503
    openai_type = "server_error"
    anthropic_type = "overloaded_error"


def from_generation(exc: KvasirError) -> ApiError:
    if isinstance(exc, UnknownModel):
        return NotFound(str(exc), "model", "model_not_found")
    if isinstance(exc, Busy):
        return TooManyRequests(str(exc), code="busy")
    if isinstance(exc, NoRoute):
        return Unavailable(str(exc), code="no_route")
    if isinstance(exc, NotServed):
        return Unavailable(
            f"the network refuses to serve this gateway: {exc}", code="gateway_not_served"
        )
    return ApiError(f"the generation failed: {exc} (the request itself was fine; retry)")
