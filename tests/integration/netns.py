"""A NAT made of Linux network namespaces (netns) for the reachability test.

    netns <tag>pub  "the internet"     pub0 10.77.1.1/24      A and R listen here
         |  veth
    netns <tag>nat  home router        nat0 10.77.1.2/24  --  nat1 10.77.2.1/24
                                       nftables masquerade out of nat0, and no
                                       forwarding of new connections inward
         |  veth
    netns <tag>lan  behind the NAT     lan0 10.77.2.2/24      C listens here

Every interface lives inside the test's own namespaces: nothing is added to, routed
through or read from the host's network. Only 10.77.0.0/16 test addresses are used.
"pub" has no route to 10.77.2.0/24, so C can dial out but nobody can dial C.

``Nat.create()`` raises ``NetnsUnavailable`` (with the reason to skip) when not root,
when ``ip netns`` is not permitted, or when neither nft nor iptables is present;
``destroy()`` removes the namespaces (their veths go with them).

Run as a script inside a namespace, ``netns.py shard-probe ...`` is a peer that dials a
node through a relay and asks it for a manifest on the shard protocol, and
``netns.py mdns-probe ...`` runs three nodes with mDNS on (two on one network name, one
on another) and reports who found whom.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

PUB_IP = "10.77.1.1"
NAT_WAN_IP = "10.77.1.2"
NAT_LAN_IP = "10.77.2.1"
LAN_IP = "10.77.2.2"

_NFT_RULES = """
table ip kvasirnat {
    chain to_wan { type nat hook postrouting priority srcnat; oifname "nat0" masquerade; }
    chain inbound {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "nat1" oifname "nat0" accept
    }
}
"""


class NetnsUnavailable(Exception):
    """Network namespaces or NAT tools cannot be used here; str() is the skip reason."""


def _run(*argv: str, stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()[:300]}")


@dataclass
class Nat:
    tag: str = field(default_factory=lambda: "kv" + secrets.token_hex(3))
    """Prefix of the namespaces' names (unique per test run)."""
    made: list[str] = field(default_factory=list)
    """Namespaces created so far (removed by destroy)."""

    @property
    def pub(self) -> str:
        return f"{self.tag}pub"

    @property
    def nat(self) -> str:
        return f"{self.tag}nat"

    @property
    def lan(self) -> str:
        return f"{self.tag}lan"

    def create(self) -> Nat:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if not shutil.which("ip"):
            raise NetnsUnavailable("iproute2 (`ip`) is not installed")
        nft, iptables = shutil.which("nft"), shutil.which("iptables")
        if not (nft or iptables):
            raise NetnsUnavailable("neither nft nor iptables is installed (native/setup "
                                   "installs nftables when run as root)")
        try:
            for ns in (self.pub, self.nat, self.lan):
                _run("ip", "netns", "add", ns)
                self.made.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            self._veth(self.pub, "pub0", f"{PUB_IP}/24", self.nat, "nat0", f"{NAT_WAN_IP}/24")
            self._veth(self.nat, "nat1", f"{NAT_LAN_IP}/24", self.lan, "lan0", f"{LAN_IP}/24")
            _run("ip", "-n", self.lan, "route", "add", "default", "via", NAT_LAN_IP)
            # Multicast (mDNS) stays on the namespace's own link.
            _run("ip", "-n", self.pub, "route", "add", "224.0.0.0/4", "dev", "pub0")
            _run("ip", "netns", "exec", self.nat, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            if nft:
                _run("ip", "netns", "exec", self.nat, "nft", "-f", "-", stdin=_NFT_RULES)
            else:
                ipt = ("ip", "netns", "exec", self.nat, "iptables")
                _run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "nat0", "-j", "MASQUERADE")
                _run(*ipt, "-P", "FORWARD", "DROP")
                _run(*ipt, "-A", "FORWARD", "-m", "conntrack", "--ctstate",
                     "ESTABLISHED,RELATED", "-j", "ACCEPT")
                _run(*ipt, "-A", "FORWARD", "-i", "nat1", "-o", "nat0", "-j", "ACCEPT")
        except BaseException:
            self.destroy()
            raise
        return self

    def _veth(self, ns_a: str, if_a: str, ip_a: str, ns_b: str, if_b: str, ip_b: str) -> None:
        # Created inside ns_a and moved straight into ns_b: it never exists on the host.
        _run("ip", "-n", ns_a, "link", "add", if_a, "type", "veth", "peer", "name", if_b,
             "netns", ns_b)
        for ns, ifname, ip in ((ns_a, if_a, ip_a), (ns_b, if_b, ip_b)):
            _run("ip", "-n", ns, "addr", "add", ip, "dev", ifname)
            _run("ip", "-n", ns, "link", "set", ifname, "up")

    def destroy(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()

    def python(self, ns: str, *args: str, timeout: float = 60) -> str:
        """Run this interpreter inside ``ns``; return its stdout."""
        done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, *args],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"python in {ns} failed: {done.stderr[-2000:]}")
        return done.stdout

    def get(self, ns: str, url: str) -> Any:
        """GET a JSON URL from inside ``ns`` (the daemons' admin APIs are on its loopback)."""
        code = "import httpx, sys; print(httpx.get(sys.argv[1], timeout=5).text)"
        return json.loads(self.python(ns, "-c", code, url))


def shard_probe(circuit_addr: str, relay_addr: str, key_dir: str) -> dict[str, Any]:
    """A fresh peer in this namespace: join the relay, dial the circuit address, ask for a
    manifest on /kvasir/shard/1 and time ten heartbeat-sized round trips."""
    import sqlite3
    import time
    from pathlib import Path

    import trio
    from libp2p.peer.id import ID

    from kvasird.config import P2PConfig
    from kvasird.identity.nodekey import create_node_key
    from kvasird.wire.protocols import SHARD_PROTOCOL
    from kvasird.p2p import P2PNode
    from kvasird.wire import read_frame, write_frame

    async def main() -> dict[str, Any]:
        config = P2PConfig(listen=(f"/ip4/{PUB_IP}/tcp/0",), bootstrap=(relay_addr,), mdns=False,
                           dht=False, peer_exchange=False, heartbeat_interval_s=1.0,
                           liveness_timeout_s=5.0)
        key = create_node_key(Path(key_dir) / f"probe-{secrets.token_hex(4)}.key")
        node = P2PNode(key, config, "natnet", sqlite3.connect(":memory:"))
        async with node.running():
            with trio.fail_after(30):
                while not node.dialer.connected(relay_addr.rsplit("/p2p/", 1)[1]):  # noqa: ASYNC110
                    await trio.sleep(0.2)
                assert await node.dialer.dial([circuit_addr]), "relayed dial failed"
            target = ID.from_base58(circuit_addr.rsplit("/p2p/", 1)[1])
            conns = node.host.get_network().connections.get(target)
            conns = conns if isinstance(conns, list) else [conns]
            relayed = "p2p-circuit" in repr([c.get_transport_addresses() for c in conns])
            with trio.fail_after(20):
                stream = await node.host.new_stream(target, [SHARD_PROTOCOL])
                rtts = []
                for _ in range(10):
                    start = time.perf_counter()
                    await write_frame(stream, {"op": "manifest", "model": "0" * 64})
                    header = await read_frame(stream, 1 << 16)
                    rtts.append((time.perf_counter() - start) * 1000)
                await stream.close()
            return {"header": header, "relayed": relayed, "rtt_ms": sorted(rtts)[len(rtts) // 2]}

    return trio.run(main)


def mdns_probe(key_dir: str) -> dict[str, Any]:
    """Three nodes in this namespace with mDNS on and no bootstrap list."""
    import sqlite3
    import time
    from pathlib import Path

    import trio

    from kvasird.config import P2PConfig
    from kvasird.identity.nodekey import create_node_key
    from kvasird.localnet.launcher import free_port
    from kvasird.p2p import P2PNode

    def node(network: str) -> P2PNode:
        config = P2PConfig(listen=(f"/ip4/{PUB_IP}/tcp/{free_port()}",), mdns=True, dht=False,
                           peer_exchange=False, heartbeat_interval_s=1.0, liveness_timeout_s=5.0)
        key = create_node_key(Path(key_dir) / f"mdns-{secrets.token_hex(4)}.key")
        return P2PNode(key, config, network, sqlite3.connect(":memory:"))

    async def main() -> dict[str, Any]:
        a, b, stranger = node("lannet"), node("lannet"), node("othernet")
        async with a.running(), b.running(), stranger.running():
            start = time.monotonic()
            with trio.move_on_after(20):
                while not (b.peer_id in a.peers and a.peer_id in b.peers):  # noqa: ASYNC110
                    await trio.sleep(0.2)
            took = time.monotonic() - start
            await trio.sleep(3)  # time for the stranger to find anyone, if it could
            return {"found": b.peer_id in a.peers and a.peer_id in b.peers, "took_s": took,
                    "stranger_peers": len(stranger.peers), "stranger_heard": stranger.lan.found,
                    "a_heard": a.lan.found}

    return trio.run(main)


if __name__ == "__main__":
    if sys.argv[1:2] == ["shard-probe"]:
        print(json.dumps(shard_probe(*sys.argv[2:5])))
    elif sys.argv[1:2] == ["mdns-probe"]:
        print(json.dumps(mdns_probe(sys.argv[2])))
