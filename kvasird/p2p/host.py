"""Building the libp2p host: Ed25519 identity, Noise only, yamux, TCP (+ WebSocket).

py-libp2p's defaults are wrong for us in three measured ways (STACK.md): they accept
plaintext peers, every connect waits out a 250 ms happy-eyeballs delay, and an
auto-dialer redials the whole peerstore every 10 s. Its TCP listeners also share their
port with any other process that asks (SO_REUSEPORT). All four are fixed here.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct

import libp2p.network.swarm as _swarm
import libp2p.transport.tcp.tcp as _tcp
import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from kvasird.errors import ConfigError
from kvasird.identity import NodeKey

# py-libp2p's yamux sends a window update on every read by default: 1,210 frames per
# 64 MiB against 274 without (measured by bench/bench_shards.py, raw stream ~200 -> 250+
# MB/s). It reads the variable at call time, so setting it before any stream suffices.
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")

# The delay is waited out even after a successful dial; dials are sequential per peer
# for us anyway (one connection per peer), so there is nothing to race.
_swarm._HAPPY_EYEBALLS_DELAY = 0


async def _open_exclusive_listeners(host: str | None, port: int) -> list[trio.SocketListener]:
    """TCP listeners that own their port, in place of py-libp2p's SO_REUSEPORT ones.

    py-libp2p sets SO_REUSEPORT so that hole punching can dial from the listen port; we
    never hole-punch (its dial falls back to an ephemeral port), and with it a second
    daemon on the same port listened too, the kernel splitting incoming handshakes
    between the two. trio's listeners set only SO_REUSEADDR: a taken port fails to bind.
    """
    return await trio.open_tcp_listeners(port, host=host)


# Looked up by name when a listener starts, so replacing it here covers every host.
_tcp._open_reuseport_listeners = _open_exclusive_listeners


def build_host(
    key: NodeKey, listen: list[str], announce: list[str], max_peers: int, psk: str | None = None
) -> IHost:
    """A host that speaks only Noise: a plaintext or secio peer fails negotiation.

    With ``psk`` (64 hex digits, see ``psk``) every connection is also wrapped in the
    private-network cipher: a peer without the same key cannot connect at all.
    """
    addrs = [multiaddr.Multiaddr(a) for a in listen]
    noise = NoiseTransport(libp2p_keypair=key.keypair, noise_privkey=new_x25519().private_key)
    conn_config = ConnectionConfig(
        max_connections=max_peers + 16,
        min_connections=0,  # no auto-dialer: bootstrap and peer exchange decide whom to dial
        low_watermark=0,
        high_watermark=max_peers + 8,
        max_connections_per_peer=1,
        dial_timeout=5.0,
        outbound_upgrade_timeout=5.0,
        inbound_upgrade_timeout=5.0,
    )
    return new_host(
        key_pair=key.keypair,
        sec_opt={NOISE_ID: noise},
        muxer_preference="YAMUX",
        listen_addrs=addrs,
        connection_config=conn_config,
        announce_addrs=[multiaddr.Multiaddr(a) for a in announce] or None,
        enable_websocket=any("/ws" in a for a in listen),
        psk=psk,
    )


def parse_listen(values: tuple[str, ...]) -> list[str]:
    """The listen addresses with every /tcp/0 resolved to a free port.

    py-libp2p 0.8.1 collapses two port-0 listeners on one IP (TCP and WebSocket) into
    one, so the WebSocket listener silently never starts; choosing the ports here
    avoids that.
    """
    if not values:
        raise ConfigError(
            "p2p.listen is empty: give at least one address such as /ip4/0.0.0.0/tcp/4001"
        )
    return [_resolve_zero_port(a) for a in values]


def _resolve_zero_port(addr: str) -> str:
    m = re.match(r"^/ip4/([0-9.]+)/tcp/0(/.*)?$", addr)
    if not m:
        return addr
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((m.group(1), 0))
        port = sock.getsockname()[1]
    return f"/ip4/{m.group(1)}/tcp/{port}{m.group(2) or ''}"


def interface_ipv4s() -> list[str]:
    """IPv4 addresses of this machine's interfaces (to expand 0.0.0.0 for the join address)."""
    out = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(),
                    0x8915,  # SIOCGIFADDR
                    struct.pack("256s", name.encode()[:15]),
                )
            except OSError:
                continue
            out.append(socket.inet_ntoa(packed[20:24]))
    finally:
        sock.close()
    return out


def dialable_addrs(host: IHost) -> list[str]:
    """The host's listen addresses with 0.0.0.0 expanded, each ending in /p2p/<id>."""
    pid = host.get_id().to_string()
    out: list[str] = []
    for addr in host.get_addrs():
        text = str(addr)
        if f"/p2p/{pid}" not in text:
            text = f"{text}/p2p/{pid}"
        if "/ip4/0.0.0.0/" in text:
            ips = interface_ipv4s() or ["127.0.0.1"]
            out.extend(text.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/") for ip in ips)
        else:
            out.append(text)
    return list(dict.fromkeys(out))
