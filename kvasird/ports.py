"""The ports a node listens on, each checked free before anything starts.

A taken port is found before the node listens on any or dials anyone, and the error names
the key that sets it ("port 4001 on 0.0.0.0 is in use: set [p2p] listen in ..."). The
listeners themselves own their ports too (p2p.host, http): a port taken between this check
and the listen fails there, with the same message, instead of being shared.
"""

from __future__ import annotations

import errno
import re
import socket
from contextlib import ExitStack
from dataclasses import dataclass

from kvasird.config import Config
from kvasird.errors import ConfigError

_MULTIADDR_TCP = re.compile(r"^/ip([46])/([^/]+)/tcp/([0-9]+)(/|$)")


@dataclass(frozen=True)
class Port:
    key: str
    """The setting that chooses it, as the operator writes it: "[p2p] listen"."""
    host: str
    """The address it is bound on (an IP; IPv6 without brackets)."""
    port: int
    """The TCP port, never 0 (a free port is always free)."""


def check_ports(config: Config, config_path: str = "kvasird.toml") -> None:
    """Raise a ConfigError naming the key to change when a configured port cannot be listened
    on (taken by another program, set twice here, or on an address this machine lacks).

    Every port is held until all are bound, so two keys naming one port are caught too;
    all are released before returning.
    """
    with ExitStack() as held:
        bound: list[Port] = []
        for p in configured_ports(config):
            try:
                held.enter_context(bind_exclusively(p.host, p.port))
            except OSError as exc:
                twin = next((b for b in bound if b.port == p.port), None)
                if twin is not None and exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"{twin.key} and {p.key} both use port {p.port}: set one "
                        f"of them to another port in {config_path}"
                    ) from None
                raise listen_error(p.key, p.host, p.port, exc, config_path) from None
            bound.append(p)


def configured_ports(config: Config) -> list[Port]:
    """Every non-zero TCP port the config makes the node listen on, in start order."""
    ports = [
        Port("[p2p] listen", host, port)
        for host, port in (multiaddr_tcp(a) for a in config.p2p.listen)
        if port
    ]
    if config.inference.lanes and config.inference.lane_port:
        lane_host = next(
            (host for host, _ in map(multiaddr_tcp, config.p2p.listen) if host), "0.0.0.0"
        )
        ports.append(Port("[inference] lane_port", lane_host, config.inference.lane_port))
    listens = [("[admin] listen", config.admin.listen)]
    if config.gateway.enabled:
        listens.append(("[gateway] listen", config.gateway.listen))
    for key, value in listens:
        host, _, port = value.rpartition(":")
        if int(port):
            ports.append(Port(key, host.strip("[]"), int(port)))
    return ports


def bind_exclusively(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` as our listeners do: with SO_REUSEADDR (a port
    our last run left in TIME_WAIT is free) and never SO_REUSEPORT (a port another
    process listens on is not). Raises OSError when the port cannot be had.

    It listens because two sockets with SO_REUSEADDR may bind one port while neither does.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(1)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_error(key: str, host: str, port: int, exc: OSError, config_path: str) -> ConfigError:
    """The one-line error for a listen on ``host:port`` (set by ``key``) that failed."""
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(
            f"port {port} on {host} is in use (by another kvasird or another "
            f"program): set {key} in {config_path} to a free port"
        )
    return ConfigError(
        f"cannot listen on {host} port {port} ({exc.strerror or exc}): set "
        f"{key} in {config_path} to a free port on an address of this machine"
    )


def multiaddr_tcp(addr: str) -> tuple[str, int]:
    """(IP, port) of an /ip4 or /ip6 TCP multiaddr; ("", 0) for any other address."""
    m = _MULTIADDR_TCP.match(addr)
    return (m.group(2), int(m.group(3))) if m else ("", 0)
