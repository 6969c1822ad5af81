"""A WAN between network namespaces, emulated in userspace: this kernel has no netem.

    netns <prefix>br    the bridge: ports p0 p1 p2 ..., no addresses, and this script's
         |              `bridge` command forwarding Ethernet frames between the ports
    veth pair per host
         |
    netns <prefix>n0    eth0 10.78.0.1/24      one daemon per namespace
    netns <prefix>n1    eth0 10.78.0.2/24
    ...

The bridge opens an AF_PACKET raw socket on every port and forwards frames the way a
learning switch does (source MACs learned; broadcast and unknown destinations flooded, so
ARP works), except that a frame crossing from port a to port b first goes through the
link a->b: it may be lost (the link's loss probability), it leaves at the link's rate
(token bucket) when one is set, and it arrives the link's one-way delay later. A frame
never overtakes an earlier one on the same link, as on a real path, even when a link's
settings change while frames are in flight.

Commands (each run inside the namespace it acts on, with `ip netns exec`):

    wan_link.py bridge p0 p1 p2     forward between these ports; read settings from stdin
    wan_link.py plain eth0          turn off checksum and segmentation offloads, so that
                                    frames leave whole and with their checksums computed
    wan_link.py echo PORT           a UDP echo server on PORT
    wan_link.py ping HOST PORT N    N UDP round trips to HOST:PORT; prints their ms (JSON)

`bridge` reads one JSON object a line on stdin, ``{"default": {"delay_ms": 20, "loss":
0.01, "rate_mbit": 0}, "links": [{"from": 0, "to": 1, "delay_ms": 5}]}`` (settings for
every link, then for some links), and answers each with one JSON line: the counts of
frames forwarded, lost and dropped so far. It exits when stdin closes (its parent gone).
The scheduling (Link, Switch) takes the time as an argument and touches no socket.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import random
import select
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
"""The packet type a port's socket sees for the frames this process itself sent there."""
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_PROMISC = 1
SIOCETHTOOL = 0x8946
ETHTOOL_STXCSUM = 0x17
ETHTOOL_SSG = 0x19
ETHTOOL_STSO = 0x1F
ETHTOOL_SGSO = 0x24
ETHTOOL_SGRO = 0x2C
FRAME_MAX = 65536
"""Receive buffer: a whole frame, even one of a port whose offloads were left on."""


@dataclass(frozen=True)
class LinkSettings:
    """What one direction of a path between two ports does to the frames crossing it."""

    delay_s: float = 0.0
    """One-way delay each frame is held for."""
    loss: float = 0.0
    """Probability that a frame is lost on the way (0..1)."""
    rate_bps: float = 0.0
    """The link's rate in bits per second; 0 = as fast as frames come."""
    burst_bytes: int = 15140
    """Bytes the token bucket holds: a burst of this much leaves at once (ten full frames),
    as from a real link's queue."""
    queue_frames: int = 10000
    """Frames waiting on the link past which new ones are dropped (a router's tail drop)."""

    @classmethod
    def from_json(cls, raw: dict[str, float], base: LinkSettings | None = None) -> LinkSettings:
        """Settings from the control line's units (ms, fraction, Mbit/s) over ``base``."""
        base = base or cls()
        return cls(
            delay_s=float(raw.get("delay_ms", base.delay_s * 1000)) / 1000,
            loss=float(raw.get("loss", base.loss)),
            rate_bps=float(raw.get("rate_mbit", base.rate_bps / 1e6)) * 1e6,
            burst_bytes=int(raw.get("burst_bytes", base.burst_bytes)),
            queue_frames=int(raw.get("queue_frames", base.queue_frames)),
        )


@dataclass
class Link:
    """One direction between two ports: its frames in flight, in the order they came."""

    settings: LinkSettings
    """What the link does (replaced by Switch.configure)."""
    queue: collections.deque[tuple[float, bytes]] = field(default_factory=collections.deque)
    """(arrival time at the far port, frame), in the order the frames came."""
    tokens: float = 0.0
    """Bytes the bucket held at ``refilled``."""
    refilled: float = -1e18
    """When ``tokens`` was counted; a link starts with a full bucket."""
    last_arrival: float = -1e18
    """When the latest frame admitted arrives: no later frame arrives before it."""
    forwarded: int = 0
    """Frames delivered to the far port."""
    lost: int = 0
    """Frames lost on the way (the loss probability)."""
    dropped: int = 0
    """Frames dropped because the link's queue was full."""

    def admit(self, now: float, frame: bytes, draw: float) -> bool:
        """Take a frame that came at ``now``; ``draw`` is a uniform number in [0, 1) that
        decides its loss. False when it will never arrive."""
        s = self.settings
        if len(self.queue) >= s.queue_frames:
            self.dropped += 1
            return False
        leaves = self._paced(now, len(frame))
        if draw < s.loss:
            self.lost += 1
            return False
        self.last_arrival = max(leaves + s.delay_s, self.last_arrival)
        self.queue.append((self.last_arrival, frame))
        return True

    def _paced(self, now: float, size: int) -> float:
        """When a frame of ``size`` bytes that came at ``now`` leaves: at once without a
        rate, else once the bucket holds its bytes (frames leave in the order they came)."""
        s = self.settings
        if s.rate_bps <= 0:
            return now
        per_s = s.rate_bps / 8
        t = max(now, self.refilled)
        tokens = min(s.burst_bytes, self.tokens + (t - self.refilled) * per_s)
        if tokens < size:
            t += (size - tokens) / per_s
            tokens = size
        self.tokens, self.refilled = tokens - size, t
        return t

    def due(self, now: float) -> list[bytes]:
        """The frames that have arrived by ``now``, in order, taken off the link."""
        out = []
        while self.queue and self.queue[0][0] <= now:
            out.append(self.queue.popleft()[1])
        self.forwarded += len(out)
        return out

    def next_arrival(self) -> float | None:
        return self.queue[0][0] if self.queue else None


class Switch:
    """A learning switch whose every port-to-port path is a Link."""

    def __init__(
        self,
        ports: int,
        default: LinkSettings | None = None,
        draw: Callable[[], float] | None = None,
    ) -> None:
        self.ports = ports
        self.links = {
            (a, b): Link(default or LinkSettings())
            for a in range(ports)
            for b in range(ports)
            if a != b
        }
        """Every direction between two ports."""
        self.macs: dict[bytes, int] = {}
        """Source MAC -> the port it was last seen on."""
        self.draw = draw or random.Random().random
        """Uniform numbers in [0, 1) that decide losses (seeded in tests)."""
        self.unsent = 0
        """Frames a port refused to send: bigger than its MTU (its host's offloads left on)
        or its queue full."""

    def configure(
        self, default: LinkSettings, links: dict[tuple[int, int], LinkSettings] | None = None
    ) -> None:
        """New settings for every link (``default``) and some (``links``); frames already
        in flight keep their arrival times and their order."""
        for pair, link in self.links.items():
            link.settings = (links or {}).get(pair, default)

    def receive(self, now: float, port: int, frame: bytes) -> None:
        """A frame that came in on ``port`` at ``now``: onto the link to its destination's
        port, or onto every other port's link for a broadcast or an unknown destination."""
        if len(frame) < 14:
            return
        dst, src = frame[:6], frame[6:12]
        if not src[0] & 1:
            self.macs[src] = port
        out = None if dst[0] & 1 else self.macs.get(dst)
        if out == port:
            return
        for to in [out] if out is not None else [p for p in range(self.ports) if p != port]:
            self.links[(port, to)].admit(now, frame, self.draw())

    def due(self, now: float) -> list[tuple[int, bytes]]:
        """(port, frame) for every frame that has arrived by ``now``."""
        return [(to, frame) for (_, to), link in self.links.items() for frame in link.due(now)]

    def next_arrival(self) -> float | None:
        times = [t for link in self.links.values() if (t := link.next_arrival()) is not None]
        return min(times) if times else None

    def counts(self) -> dict[str, int]:
        links = self.links.values()
        return {
            "forwarded": sum(x.forwarded for x in links),
            "lost": sum(x.lost for x in links),
            "dropped": sum(x.dropped for x in links),
            "unsent": self.unsent,
        }

    def apply(self, line: str) -> None:
        """Settings from one control line (see the module's docstring)."""
        raw = json.loads(line)
        default = LinkSettings.from_json(raw.get("default", {}))
        self.configure(
            default,
            {
                (int(x["from"]), int(x["to"])): LinkSettings.from_json(x, default)
                for x in raw.get("links", [])
            },
        )


def open_port(name: str) -> socket.socket:
    """A raw socket that sees every frame on the port ``name`` (promiscuous) and sends
    frames out of it."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((name, 0))
    mreq = struct.pack("iHH8s", socket.if_nametoindex(name), PACKET_MR_PROMISC, 0, b"")
    sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    sock.setblocking(False)
    return sock


def bridge(
    names: list[str],
    control: int = 0,
    out: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Forward frames between the ports ``names`` until ``control`` (a file descriptor
    carrying settings lines) closes."""
    switch = Switch(len(names))
    socks = [open_port(name) for name in names]
    ports = {sock.fileno(): i for i, sock in enumerate(socks)}
    pending = b""
    out(json.dumps({"ready": names, "realtime": realtime()}))
    while True:
        due = switch.next_arrival()
        wait = None if due is None else max(0.0, due - clock())
        readable, _, _ = select.select([control, *ports], [], [], wait)
        for ready in readable:
            if ready == control:
                chunk = os.read(control, 65536)
                if not chunk:
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    switch.apply(line.decode())
                    out(json.dumps(switch.counts()))
            else:
                _drain(socks[ports[ready]], ports[ready], switch, clock)
        for port, frame in switch.due(clock()):
            try:
                socks[port].send(frame)
            except OSError:
                switch.unsent += 1


def realtime() -> bool:
    """Run this process before the machine's other work (SCHED_FIFO, the lowest real-time
    priority), so that a busy machine delays the frames it holds as little as it can: a
    link's delay is the wire's, not the scheduler's. It sleeps in select() between frames.
    False where not permitted."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError:
        return False
    return True


def _drain(sock: socket.socket, port: int, switch: Switch, clock: Callable[[], float]) -> None:
    """Every frame waiting on a port's socket, except those this process sent there."""
    while True:
        try:
            frame, addr = sock.recvfrom(FRAME_MAX)
        except BlockingIOError:
            return
        if addr[2] != PACKET_OUTGOING:
            switch.receive(clock(), port, frame)


def plain(name: str) -> None:
    """Turn off the offloads that let a veth hand over frames bigger than its MTU or
    without their checksum: a frame forwarded by a raw socket must be a real one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for cmd in (ETHTOOL_STXCSUM, ETHTOOL_SSG, ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SGRO):
            value = ctypes.create_string_buffer(struct.pack("II", cmd, 0))
            ifreq = struct.pack("16sP", name.encode(), ctypes.addressof(value))
            fcntl.ioctl(sock, SIOCETHTOOL, ifreq)


def echo(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", port))
        print(json.dumps({"ready": port}), flush=True)
        while True:
            data, addr = sock.recvfrom(2048)
            sock.sendto(data, addr)


def ping(host: str, port: int, n: int, timeout_s: float = 2.0) -> list[float]:
    """Milliseconds of ``n`` UDP round trips (a lost one is left out)."""
    times = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        for i in range(n):
            began = time.perf_counter()
            sock.sendto(struct.pack("I", i), (host, port))
            try:
                while struct.unpack("I", sock.recv(64)[:4])[0] != i:
                    pass
            except TimeoutError:
                continue
            times.append((time.perf_counter() - began) * 1000)
    return times


def main(argv: Iterable[str]) -> None:
    command, *args = argv
    if command == "bridge":
        bridge(args, out=lambda line: print(line, flush=True))
    elif command == "plain":
        plain(args[0])
    elif command == "echo":
        echo(int(args[0]))
    elif command == "ping":
        print(json.dumps(ping(args[0], int(args[1]), int(args[2]))))
    else:
        raise SystemExit(f"unknown command {command!r}: bridge, plain, echo or ping")


if __name__ == "__main__":
    main(sys.argv[1:])
