"""Routes of the admin API. Status handlers only read snapshots of the node's state; the
auth handlers keep sign-in state in the settlement ledger.

The admin API is for this machine: the CLI reaches it on loopback and needs nothing
more (it can read the home anyway). A request from any other address must carry
``Authorization: Bearer <token>`` of an operator session, which the operator gets by
signing in with the operator wallet and a TOTP code:

    POST /v0/auth/challenge                                   → {"message", "nonce", "expires_at"}
    POST /v0/auth/sign-in {"message", "signature", "totp"}    → {"token", "expires_at"}
    POST /v0/auth/totp                                        → {"uri"}   (loopback only, once)

``GET /v0/serving`` is what `kvasird status` adds to ``/v0/status``: the model (name and
id), the units held of it, the gateway's health. ``POST /v0/bootstrap {"addr"}`` dials a
peer at once and keeps it connected, as the bootstrap list does (``kvasird bootstrap add``
on a running daemon, like kubo's ``swarm connect``): ``{"peer_id", "connected", "error"}``.

The two sign-in routes are open to everyone; TOTP enrolment never is open to other
machines, not even with a session, since a stolen session must not mint a new second
factor. Sign-in needs settlement (the operator wallet); without it other machines are
refused outright.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from solders.signature import Signature
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvasird.config.load import check_multiaddr
from kvasird.errors import ConfigError
from kvasird.gateway.body import read_json
from kvasird.gateway.errors import ApiError, BadRequest
from kvasird.http import is_loopback
from kvasird.p2p.dialer import peer_id_of
from kvasird.settlement.admin import AdminAuth
from kvasird.settlement.errors import AdminAuthError, TotpAlreadyEnrolled

if TYPE_CHECKING:
    from kvasird.gateway.service import Health
    from kvasird.gateway.status import NodeView
    from kvasird.p2p.dialer import Dialer
    from kvasird.settlement.service import Settlement

MAX_SIGN_IN_BYTES = 8192
"""Largest sign-in body read (a SIWS message is a few hundred bytes; anyone may post one)."""
MAX_BOOTSTRAP_BYTES = 4096
"""Largest bootstrap body read (one multiaddr)."""
OPEN_TO_ALL = frozenset({"/v0/auth/challenge", "/v0/auth/sign-in"})
"""Paths other machines may use without a session: the ones that give them one."""
HOW_TO_SIGN_IN = (
    "POST /v0/auth/challenge, sign its message with the operator wallet, POST /v0/auth/sign-in "
    '{"message", "signature" (base58), "totp"}, and send "Authorization: Bearer <token>"'
)
NO_SETTLEMENT = (
    "operator sign-in needs the operator wallet: set [settlement] enabled = true in the "
    "node's kvasird.toml, or use the admin API from the node's own machine"
)


@dataclass(frozen=True)
class AdminNode:
    """What the admin API reads and does of its node (the daemon builds it)."""

    view: NodeView
    """The node's status, peers, coverage and shards, as the gateway's /status reads them."""
    dialer: Dialer
    """Dials a bootstrap address at once and keeps it connected (POST /v0/bootstrap)."""
    settlement: Callable[[], Settlement | None]
    """Governance, the price and operator sign-in (None while [settlement] is off)."""
    health: Callable[[], Health] | None
    """The gateway's health (None: [gateway] enabled = false)."""


def build_app(node: AdminNode) -> Starlette:
    async def status(_: Request) -> JSONResponse:
        return JSONResponse(node.view.status())

    async def serves(_: Request) -> JSONResponse:
        return JSONResponse(serving(node))

    async def peers(_: Request) -> JSONResponse:
        return JSONResponse([p.to_json() for p in node.view.peers()])

    async def coverage(_: Request) -> JSONResponse:
        return JSONResponse(node.view.coverage())

    async def shards(_: Request) -> JSONResponse:
        return JSONResponse(node.view.shards())

    async def bootstrap(request: Request) -> JSONResponse:
        try:
            addr = (await read_json(request, MAX_BOOTSTRAP_BYTES)).string("addr")
            check_multiaddr(addr, True, "addr")
        except ApiError as exc:
            return _error(exc.status, exc.message)
        except ConfigError as exc:
            return _error(400, str(exc))
        dialer, pid = node.dialer, peer_id_of(addr)
        dialer.add_bootstrap(addr)
        connected = await dialer.dial([addr])
        return JSONResponse(
            {
                "peer_id": pid,
                "connected": connected,
                "error": None if connected else dialer.failures.get(pid),
            }
        )

    async def settlement(_: Request) -> JSONResponse:
        s = node.settlement()
        if s is None:
            return JSONResponse({"enabled": False})
        return JSONResponse(
            {
                "enabled": True,
                "params": s.governance.params().to_wire(),
                "price_per_1k_tokens": s.prices.price,
            }
        )

    def admin_auth() -> AdminAuth | None:
        s = node.settlement()
        return s.admin if s is not None else None

    async def challenge(_: Request) -> JSONResponse:
        auth = admin_auth()
        if auth is None:
            return _error(404, NO_SETTLEMENT)
        c = auth.challenge()
        return JSONResponse({"message": c.message, "nonce": c.nonce, "expires_at": c.expires_at})

    async def sign_in(request: Request) -> JSONResponse:
        auth = admin_auth()
        if auth is None:
            return _error(404, NO_SETTLEMENT)
        try:
            message, signature, totp = await _sign_in_fields(request)
            session = auth.sign_in(message, signature, totp)
        except ApiError as exc:
            return _error(exc.status, exc.message)
        except AdminAuthError as exc:
            return _error(401, str(exc))
        return JSONResponse({"token": session.token, "expires_at": session.expires_at})

    async def enroll_totp(request: Request) -> JSONResponse:
        auth = admin_auth()
        if auth is None:
            return _error(404, NO_SETTLEMENT)
        if not is_loopback(_client_host(request.scope)):
            return _error(
                403,
                "TOTP enrolment is allowed only from this machine: run "
                "POST /v0/auth/totp on the node itself",
            )
        try:
            return JSONResponse({"uri": auth.enroll_totp()})
        except TotpAlreadyEnrolled as exc:
            return _error(409, str(exc))

    return Starlette(
        routes=[
            Route("/v0/settlement", settlement),
            Route("/v0/shards", shards),
            Route("/v0/status", status),
            Route("/v0/serving", serves),
            Route("/v0/peers", peers),
            Route("/v0/coverage", coverage),
            Route("/v0/bootstrap", bootstrap, methods=["POST"]),
            Route("/v0/auth/challenge", challenge, methods=["POST"]),
            Route("/v0/auth/sign-in", sign_in, methods=["POST"]),
            Route("/v0/auth/totp", enroll_totp, methods=["POST"]),
        ],
        middleware=[Middleware(OperatorGate, auth=admin_auth)],
    )


def serving(node: AdminNode) -> dict[str, Any]:
    """What `kvasird status` adds to the node's own status: the model it serves (name and
    id), the units it holds of it, and its gateway's health."""
    cov = node.view.coverage()
    model = cov["model"]
    health = node.health() if node.health is not None else None
    return {
        "model": {"name": model["name"], "id": model["id"]} if model else None,
        "role": {
            "state": cov["state"],
            "units": cov["held"],
            "held_bytes": cov["held_bytes"],
            "budget_bytes": cov["budget_bytes"],
            "routable": cov["routable"],
        },
        "health": {"status": health.status, "reason": health.reason} if health else None,
    }


class OperatorGate:
    """ASGI middleware: loopback clients pass; others need an operator session's bearer token.

    It wraps the whole app, so routes other subsystems add later are behind it too.
    """

    def __init__(self, app: ASGIApp, auth: Callable[[], AdminAuth | None]) -> None:
        """``auth`` returns the node's AdminAuth, or None while settlement is off."""
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] in ("http", "websocket") else None
        if refusal is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await _error(401, refusal, {"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _refusal(self, scope: Scope) -> str | None:
        if is_loopback(_client_host(scope)) or scope["path"] in OPEN_TO_ALL:
            return None
        auth = self.auth()
        if auth is None:
            return f"this admin API answers other machines only after sign-in, and {NO_SETTLEMENT}"
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip() and auth.session_valid(token.strip()):
            return None
        return (
            "this admin API answers other machines only with an operator session: " + HOW_TO_SIGN_IN
        )


async def _sign_in_fields(request: Request) -> tuple[str, Signature, str]:
    f = await read_json(request, MAX_SIGN_IN_BYTES)
    message, signature, totp = f.string("message"), f.string("signature"), f.string("totp")
    try:
        return message, Signature.from_string(signature), totp
    except ValueError:
        raise BadRequest(
            "`signature` must be the base58 signature of the message's UTF-8 "
            "bytes by the operator wallet",
            "signature",
        ) from None


def _client_host(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)
