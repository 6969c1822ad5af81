"""Serving an ASGI app with hypercorn inside a trio nursery (admin API, gateway).

Every app served here is behind a HostGuard: both surfaces are meant for this machine
(or names the operator listed), never for whatever web page the operator's browser shows;
a gateway that listens on every address and favours this machine in nothing is meant for
anyone. Whether a request is the operator's own, from this machine, is decided by
operator_request alone. Every request is logged once, by AccessLog, without anything secret.
"""

from __future__ import annotations

import ipaddress
import logging
import time
import typing
from collections.abc import Mapping, MutableMapping
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvasird.logs import get_logger
from kvasird.ports import listen_error

log = get_logger("kvasird.http")

ACCESS_NOTES = "kvasird.access"
"""The scope key of the dict whose items an app adds to its request's access event."""
MAX_LOGGED_PATH = 200
"""Characters of a request's path logged (a client chooses the path of a 404)."""
RELAY_HEADERS = (b"forwarded", b"x-forwarded-for", b"x-real-ip", b"x-forwarded-host")
"""Headers a proxy adds to the requests it relays. Only their presence is read, never their
value: anyone can write them, and their presence only ever takes a privilege away."""


async def serve_asgi(
    app: ASGIApp,
    bind: str,
    *,
    what: str,
    section: str,
    config_path: str,
    allowed_hosts: tuple[str, ...],
    favours_this_machine: bool = True,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``bind`` (host:port, port 0 = free); report the real URL when listening.

    Only requests addressed to a loopback name, the bind host or one of ``allowed_hosts``
    (``[section] allowed_hosts``) reach the app, unless it is a public one (see HostGuard).
    """
    cfg = HypercornConfig()
    cfg.bind = [bind]
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.graceful_timeout = 2.0
    guarded = AccessLog(
        HostGuard(
            app,
            bind,
            allowed_hosts,
            what=what,
            hint=f"[{section}] allowed_hosts in {config_path}",
            favours_this_machine=favours_this_machine,
        ),
        what=what,
    )
    started = _FirstBind(task_status)
    try:
        await serve(
            guarded,  # type: ignore[arg-type] # starlette and hypercorn type ASGI apart
            cfg,
            task_status=started,
        )
    except* OSError as group:  # hypercorn binds inside its nursery
        if started.listening:
            raise
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        host, _, port = bind.rpartition(":")
        raise listen_error(
            f"[{section}] listen",
            host.strip("[]"),
            int(port),
            typing.cast(OSError, exc),
            config_path,
        ) from None


def note_access(scope: MutableMapping[str, Any], **fields: int | str) -> None:
    """Add ``fields`` (token counts, say) to the access event of the request of ``scope``.

    Only counts and names belong here: the event is written to the log as it is.
    """
    notes = scope.get(ACCESS_NOTES)
    if notes is not None:
        notes.update(fields)


class AccessLog:
    """ASGI middleware that logs one "request" event per HTTP request once it is answered:
    the surface, method, path, status, milliseconds, and what the app noted (note_access).

    Never the query string, headers or body: they carry API keys, payment proofs and
    prompts. A request whose answer never started (the client left) has status 499.
    """

    def __init__(self, app: ASGIApp, *, what: str) -> None:
        self.app = app
        self.what = what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0
        notes: dict[str, Any] = {}
        scope[ACCESS_NOTES] = notes

        async def send_noting_status(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except Exception:
            status = status or 500
            raise
        finally:
            log.info(
                "request",
                **{
                    **notes,
                    "api": self.what,
                    "method": scope["method"],
                    "path": scope["path"][:MAX_LOGGED_PATH],
                    "status": status or 499,
                    "ms": round((time.perf_counter() - started) * 1000, 1),
                },
            )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, IPv6 optionally in brackets, or "localhost") is this
    machine only. An IPv4 client of a dual-stack ``[::]`` listener shows as
    ``::ffff:127.0.0.1``, which is loopback too. Junk and DNS names other than localhost
    are not: what they resolve to is up to whoever controls their DNS."""
    name = _unbracketed(host)
    if name.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def is_wildcard(host: str) -> bool:
    """Whether ``host`` (an IP address, IPv6 optionally in brackets) is every address of this
    machine: 0.0.0.0 or ::."""
    try:
        return ipaddress.ip_address(_unbracketed(host)).is_unspecified
    except ValueError:
        return False


def relay_header(scope: Mapping[str, Any]) -> str | None:
    """The first of RELAY_HEADERS the request of ``scope`` carries; None when it carries none."""
    for name, _ in scope.get("headers") or ():
        if name.lower() in RELAY_HEADERS:
            return name.decode("latin-1")
    return None


def operator_request(scope: Mapping[str, Any]) -> bool:
    """Whether the request of ``scope`` is the operator's own, from this machine: its socket
    peer is loopback and no proxy says it relays the request (RELAY_HEADERS).

    A reverse proxy on this machine connects from loopback for every client it relays; most
    add X-Forwarded-For or Forwarded, and their clients are strangers here. A proxy or tunnel
    that adds neither still makes its clients look local: that is why [settlement]
    free_local is off by default where the gateway listens beyond loopback."""
    client = (scope.get("client") or ("", 0))[0]
    return is_loopback(client) and relay_header(scope) is None


class HostGuard:
    """ASGI middleware that refuses requests a web page could have made the browser send.

    A page the operator visits can post to 127.0.0.1 (cross-site request forgery: the
    browser then sends the page's Origin), or make a name of its own resolve to 127.0.0.1
    (DNS rebinding: the browser then sends that name as Host). So the Host must be a
    loopback name, the host we are bound to, or one the operator allowed, and an Origin,
    when there is one, must have such a host too. Clients that are not browsers send no
    Origin and a Host they were given, and pass. Lifespan events pass through.

    A public app answers to any Host: one bound to every address (0.0.0.0, [::]) whose
    operator listed no names and that favours this machine in nothing (a gateway where
    requests from here pay like any other). A rebound name reaches there only what every
    host of the network reaches directly, and remote clients may use any name or address.
    The Origin check stays: a page's POST carries the page's Origin and is refused as
    before, so past a firewall a page reads at most what GET shows anyone (models, health).
    The admin API always favours this machine.
    """

    def __init__(
        self,
        app: ASGIApp,
        bind: str,
        allowed_hosts: tuple[str, ...],
        *,
        what: str,
        hint: str,
        favours_this_machine: bool = True,
    ) -> None:
        """``hint`` says where to allow a name, e.g. "[gateway] allowed_hosts in PATH";
        ``favours_this_machine``: the app gives requests from this machine what it gives no
        one else (the admin API; a gateway whose requests from here need no quote)."""
        self.app = app
        self.what = what
        self.hint = hint
        names = {_unbracketed(h).lower() for h in allowed_hosts}
        bound = _hostname(bind)
        if bound and not is_wildcard(bound):
            names.add(bound)
        self.allowed = frozenset(names)
        self.any_host = is_wildcard(bound) and not allowed_hosts and not favours_this_machine
        """A public app: every Host is served."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            refusal = self._refusal(dict(scope.get("headers") or ()))
            if refusal is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                else:
                    await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, headers: dict[bytes, bytes]) -> JSONResponse | None:
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.any_host and not self._ours(_hostname(host)):
            return _refuse(
                421,
                f"the {self.what} does not answer to the name {host!r} in the "
                "Host header (a guard against DNS rebinding): to reach it by the "
                f"name {_hostname(host) or host!r}, add it to {self.hint}",
            )
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            scheme, sep, rest = text.partition("://")
            if not (sep and scheme and self._ours(_hostname(rest.partition("/")[0]))):
                return _refuse(
                    403,
                    f"the {self.what} refuses requests from the web page at "
                    f"{text!r} (a guard against cross-site requests): to allow pages "
                    f"of that site, add its host name to {self.hint}",
                )
        return None

    def _ours(self, hostname: str) -> bool:
        return bool(hostname) and (is_loopback(hostname) or hostname in self.allowed)


def _hostname(authority: str) -> str:
    """The lower-case host of ``host[:port]`` (IPv6 in brackets, returned without them);
    "" when ``authority`` is not of that form."""
    if authority.startswith("["):
        address, sep, rest = authority[1:].partition("]")
        ok = sep and (not rest or (rest[0] == ":" and rest[1:].isdigit()))
        return address.lower() if ok else ""
    name, sep, port = authority.partition(":")
    return name.lower() if not sep or port.isdigit() else ""


def _unbracketed(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _refuse(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error"}}, status_code=status
    )


class _FirstBind:
    """Adapts hypercorn's started(list of binds) to started(first URL)."""

    def __init__(self, status: trio.TaskStatus[str]) -> None:
        self._status = status
        self.listening = False

    def started(self, binds: list[str] | None = None) -> None:
        self.listening = True
        self._status.started((binds or [""])[0])
