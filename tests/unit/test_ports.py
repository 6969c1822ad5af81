"""check_ports: a port that cannot be had is refused before start, naming its key; the p2p
listener owns its port."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import multiaddr
import pytest
import trio
import trio.lowlevel

from kvasird.config import AdminConfig, Config, GatewayConfig, InferenceConfig, P2PConfig
from kvasird.errors import ConfigError
from kvasird.identity import create_node_key
from kvasird.localnet.launcher import free_port
from kvasird.p2p.host import build_host
from kvasird.ports import bind_exclusively, check_ports, configured_ports

PATH = "/srv/kvasird/kvasird.toml"




def config(p2p: int = 0, lane: int = 0, admin: int = 0, gateway: int = 0) -> Config:
    return Config().replace(
        p2p=P2PConfig(listen=(f"/ip4/127.0.0.1/tcp/{p2p}", "/ip4/127.0.0.1/tcp/0/ws")),
        inference=InferenceConfig(lane_port=lane),
        admin=AdminConfig(listen=f"127.0.0.1:{admin}"),
        gateway=GatewayConfig(listen=f"127.0.0.1:{gateway}"))


@pytest.fixture
def four_ports() -> dict[str, int]:
    """Ports from below the kernel's ephemeral range (launcher.free_port): one the kernel
    handed out (bind to port 0) went to another test's connection before this test bound it
    again, once in a CI run."""
    return {"p2p": free_port(), "lane": free_port(), "admin": free_port(), "gateway": free_port()}


def listener(port: int, reuse_port: bool = False) -> socket.socket:
    """A socket listening on 127.0.0.1:port, shareable when ``reuse_port`` (as py-libp2p's)."""
    s = socket.socket()
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


@pytest.fixture
def taken() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def test_free_ports_pass_and_are_released(four_ports: dict[str, int]) -> None:
    check_ports(config(**four_ports), PATH)
    for port in four_ports.values():
        bind_exclusively("127.0.0.1", port).close()


def test_every_configured_port_is_checked(four_ports: dict[str, int]) -> None:
    ports = configured_ports(config(**four_ports))
    assert [(p.key, p.port) for p in ports] == [
        ("[p2p] listen", four_ports["p2p"]), ("[inference] lane_port", four_ports["lane"]),
        ("[admin] listen", four_ports["admin"]), ("[gateway] listen", four_ports["gateway"])]
    assert {p.host for p in ports} == {"127.0.0.1"}


@pytest.mark.parametrize(("which", "key"), [
    ("p2p", "[p2p] listen"), ("lane", "[inference] lane_port"),
    ("admin", "[admin] listen"), ("gateway", "[gateway] listen")])
@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_taken_port_is_refused_naming_its_key(four_ports: dict[str, int],
                                                taken: list[socket.socket], which: str,
                                                key: str, reuse_port: bool) -> None:
    """Also when the other listener allows sharing (SO_REUSEPORT, as py-libp2p's did)."""
    taken.append(listener(four_ports[which], reuse_port))
    with pytest.raises(ConfigError) as err:
        check_ports(config(**four_ports), PATH)
    message = str(err.value)
    assert message == (f"port {four_ports[which]} on 127.0.0.1 is in use (by another kvasird or "
                       f"another program): set {key} in {PATH} to a free port")
    for other, port in four_ports.items():
        if other != which:
            bind_exclusively("127.0.0.1", port).close()


def test_two_keys_on_one_port_are_both_named(four_ports: dict[str, int]) -> None:
    four_ports["gateway"] = four_ports["admin"]
    with pytest.raises(ConfigError, match=r"^\[admin\] listen and \[gateway\] listen both use "
                                          rf"port {four_ports['admin']}: set one of them"):
        check_ports(config(**four_ports), PATH)


def test_an_address_this_machine_lacks_is_refused_naming_its_key() -> None:
    cfg = config().replace(p2p=P2PConfig(listen=("/ip4/192.0.2.1/tcp/4001",)))
    with pytest.raises(ConfigError, match=r"^cannot listen on 192\.0\.2\.1 port 4001 \(.+\): set "
                                          r"\[p2p\] listen in /srv/kvasird/kvasird\.toml"):
        check_ports(cfg, PATH)


def test_ports_left_to_the_system_or_unused_are_not_checked(taken: list[socket.socket]) -> None:
    port = free_port()
    taken.append(listener(port))
    cfg = config(lane=port, gateway=port).replace(
        inference=InferenceConfig(lane_port=port, lanes=False),
        gateway=GatewayConfig(listen=f"127.0.0.1:{port}", enabled=False))
    assert configured_ports(cfg) == []
    check_ports(cfg, PATH)


async def test_the_p2p_listener_does_not_share_its_port(tmp_path: Path) -> None:
    """py-libp2p's TCP listener set SO_REUSEPORT: a second one on its port listened too."""
    port = free_port()
    host = build_host(create_node_key(tmp_path / "node.key"), [f"/ip4/127.0.0.1/tcp/{port}"],
                      [], 8)
    async with host.run([multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")]):
        assert f"/ip4/127.0.0.1/tcp/{port}" in host.get_network().listeners
        with pytest.raises(OSError):
            listener(port, reuse_port=True).close()
        await trio.lowlevel.checkpoint()
