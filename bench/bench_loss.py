"""What a lost packet costs a hop's link, for each way of carrying a chain step across it.

    sudo .venv/bin/python bench/bench_loss.py [--exchanges 2000] [--delay-ms 20]
                                              [--loss 0.01] [--dtype f32]
                                              [--congestion cubic]
                                              [--options tcp thin ...] [--json PATH]

Needs root (network namespaces). Two namespaces joined through bench/wan_link.py's frame
bridge (bench_wan.Wan: this kernel has no netem), every link ``--delay-ms`` one way, first
lossless, then with ``--loss`` per frame in each direction. A client in one namespace and
a server in the other exchange what a ring hop exchanges per token, one at a time: a chain
step (one hidden row of the bundled model, ``--dtype``, with a lane record's overhead) one
way, its small result back. A step of f32 is two packets, of f16 one: either way too few
for duplicate ACKs, so plain TCP finds a lost tail only by a tail-loss probe or an RTO.
TCP's congestion control is the machine's unless ``--congestion`` names one (BBR paces the
second packet of a step once its estimate of a thin stream's rate is low; cubic does not).

Every option runs at once on the same link, each with its own client and server process
(so each sees the same conditions; none waits for another):

    tcp          TCP_NODELAY: what a lane is today (trio sets it on every SocketStream)
    thin         + TCP_THIN_LINEAR_TIMEOUTS (no exponential backoff while a stream is thin)
    quickack     + TCP_QUICKACK after every read (no delayed ACK)
    route-rto    + a route with ``rto_min 10ms`` to the other side (``ip route``: root)
    sock-rto     + TCP_RTO_MIN_US 10 ms on the socket (Linux >= 6.15; no privilege)
    tcp-x2       every frame on two TCP connections at once, the first to arrive wins
    sock-rto-x2  the same with TCP_RTO_MIN_US on both connections
    udp          a datagram lane: the step's datagrams sent again after 1.2 smoothed
                 round trips without a result (the server answers a resent step again)
    udp-x2       the same, every datagram sent twice back to back

Per option and loss: the round trip of an exchange (ms: p50 / p99 / max), how many
exchanges a loss cost more than two round trips (slower than 3 x 2 x delay), what the
kernel or the lane retransmitted (TCP: retransmitted segments and RTOs from TCP_INFO), the
IP packets and bytes both sides sent per exchange and the CPU both processes used per
exchange (Python's, the same for every option: compare, do not add up). The JSON adds
every round trip and where each connection's congestion control ended (cwnd, ssthresh,
smoothed RTT, RTO).

Namespaces are named ``kvloss<pid>...`` (10.78.0.0/24 inside them); nothing touches the
host's own network. Every namespace and process the run makes is removed at its end, on
SIGINT and SIGTERM too; a run removes what a killed earlier one left.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wan_link import realtime  # noqa: E402

PREFIX = "kvloss"
"""Every namespace this benchmark makes is named PREFIX + its process id + a role."""
HIDDEN = 576
"""The bundled model's (SmolLM2-135M) hidden size: one row of a chain step."""
RECORD_OVERHEAD = 64
"""A step's fields besides the row, its length prefix and its seal's tag, in a lane record."""
RESULT_BYTES = 48
"""A step's result: the token and its bookkeeping, sealed."""
WARMUP = 20
"""Exchanges first, not counted: connections set up, addresses resolved, RTT estimated."""
BASE_PORT = 7300
ROUTE_ADDRS = (".11", ".12")
"""Second addresses of the client and the server: their routes carry ``rto_min`` (so only
the route-rto option's connection gets it)."""
RTO_MIN_US = 10_000
TCP_RTO_MIN_US = 45
"""linux/tcp.h (6.15): a socket's own minimum RTO, in microseconds."""
TCP_THIN_LINEAR_TIMEOUTS = 16
TCP_INFO_LEN = 248
CONGESTION = "net.ipv4.tcp_congestion_control"
"""A namespace's default, from the machine's. A socket's own (TCP_CONGESTION) may be one
outside net.ipv4.tcp_allowed_congestion_control only with CAP_NET_ADMIN, as here."""
DATAGRAM = 1400
"""The largest piece of a step a datagram carries (no IP fragments on a 1500 MTU)."""
UDP_FIRST_WAIT_S = 0.2
"""How long a datagram lane waits for its first result before sending again."""
UDP_RESEND_FACTOR = 1.2
"""A datagram lane sends a step again after this many smoothed round trips."""
_STEP = struct.Struct(">II")
"""A TCP frame's head: its length (after these 4 bytes), the exchange's number."""
_DGRAM = struct.Struct(">IBBB")
"""A datagram's head: exchange number, piece, pieces, attempt (0 = first send)."""
BYE = 0xFFFFFFFF


@dataclass(frozen=True)
class Option:
    """One way of carrying a hop's steps."""

    name: str
    """Its row in the table."""
    text: str
    """What it is, for the table's key."""
    udp: bool = False
    """A datagram lane instead of TCP."""
    copies: int = 1
    """TCP connections every frame goes on, or times every datagram is sent."""
    sockopts: tuple[tuple[int, int], ...] = ()
    """(TCP option, value) set on every connection besides TCP_NODELAY."""
    quickack: bool = False
    """TCP_QUICKACK again after every read (the kernel clears it)."""
    route: bool = False
    """Connect between the second addresses, whose routes carry ``rto_min``."""


OPTIONS = {
    o.name: o
    for o in (
        Option("tcp", "TCP_NODELAY (lanes today)"),
        Option("thin", "+ TCP_THIN_LINEAR_TIMEOUTS", sockopts=((TCP_THIN_LINEAR_TIMEOUTS, 1),)),
        Option("quickack", "+ TCP_QUICKACK after every read", quickack=True),
        Option("route-rto", "+ ip route ... rto_min 10ms (root)", route=True),
        Option("sock-rto", "+ TCP_RTO_MIN_US 10 ms", sockopts=((TCP_RTO_MIN_US, RTO_MIN_US),)),
        Option("tcp-x2", "two TCP connections, first arrival wins", copies=2),
        Option(
            "sock-rto-x2",
            "two TCP connections + TCP_RTO_MIN_US 10 ms",
            copies=2,
            sockopts=((TCP_RTO_MIN_US, RTO_MIN_US),),
        ),
        Option("udp", "datagrams, resent after 1.2 smoothed RTT", udp=True),
        Option("udp-x2", "datagrams sent twice, resent after 1.2 RTT", udp=True, copies=2),
    )
}


# --- the peers (run in the namespaces; the standard library only) -----------------------


@dataclass
class Sent:
    """What one side put on the wire (datagram lanes count their own)."""

    packets: int = 0
    """IP packets."""
    ip_bytes: int = 0
    """Their bytes, IP and transport headers included."""
    resent: int = 0
    """Packets sent again (TCP: retransmitted segments)."""
    rtos: int = 0
    """Retransmission timeouts (TCP only)."""

    def add(self, other: Sent) -> None:
        self.packets += other.packets
        self.ip_bytes += other.ip_bytes
        self.resent += other.resent
        self.rtos += other.rtos


def tcp_sent(sock: socket.socket) -> Sent:
    """What the kernel sent on a connection, from its TCP_INFO: segments (pure ACKs too),
    bytes with the IPv4, TCP and timestamp headers, retransmissions and RTOs."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    total_retrans = struct.unpack_from("I", info, 100)[0]
    segs_out = struct.unpack_from("I", info, 136)[0]
    bytes_sent = struct.unpack_from("Q", info, 200)[0]
    total_rto = struct.unpack_from("H", info, 240)[0] if len(info) >= 242 else 0
    return Sent(segs_out, bytes_sent + segs_out * 52, total_retrans, total_rto)


def tcp_state(sock: socket.socket) -> dict[str, int]:
    """Where a connection's congestion control left it (for the JSON)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    rtt_us, rttvar_us, ssthresh, cwnd = struct.unpack_from("4I", info, 68)
    pacing = struct.unpack_from("Q", info, 104)[0]
    rto_us = struct.unpack_from("I", info, 8)[0]
    return {"rtt_us": rtt_us, "rttvar_us": rttvar_us, "ssthresh": ssthresh, "cwnd": cwnd,
            "pacing_Bps": pacing, "rto_us": rto_us}  # fmt: skip


def tcp_socket(opt: Option, sock: socket.socket, congestion: str) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    for name, value in opt.sockopts:
        sock.setsockopt(socket.IPPROTO_TCP, name, value)
    return sock


class Frames:
    """The exchange numbers of the whole frames in a TCP stream's bytes so far."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> Iterator[int]:
        self.buf += data
        while len(self.buf) >= 4:
            size = struct.unpack_from(">I", self.buf)[0]
            if len(self.buf) < 4 + size:
                return
            seq = struct.unpack_from(">I", self.buf, 4)[0]
            del self.buf[: 4 + size]
            yield seq


def frame(seq: int, size: int) -> bytes:
    return _STEP.pack(size - 4, seq) + bytes(size - _STEP.size)


def serve_tcp(opt: Option, port: int, congestion: str) -> dict[str, Any]:
    """Answer every step once, on every connection, the first time it arrives."""
    with socket.create_server(("0.0.0.0", port)) as listener:
        print(json.dumps({"ready": port}), flush=True)
        conns = [tcp_socket(opt, listener.accept()[0], congestion) for _ in range(opt.copies)]
    sel = selectors.DefaultSelector()
    for conn in conns:
        sel.register(conn, selectors.EVENT_READ, (conn, Frames()))
    answered, sent, open_ = -1, Sent(), len(conns)
    while open_:
        for key, _ in sel.select():
            conn, frames = key.data
            data = conn.recv(65536)
            if opt.quickack:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            if not data:
                sel.unregister(conn)
                open_ -= 1
                continue
            for seq in frames.feed(data):
                if seq > answered:
                    answered = seq
                    for c in conns:
                        c.sendall(frame(seq, RESULT_BYTES))
    states = [tcp_state(conn) for conn in conns]
    for conn in conns:
        sent.add(tcp_sent(conn))
        conn.close()
    return {"sent": asdict(sent), "tcp": states}


def call_tcp(
    opt: Option, host: str, port: int, n: int, size: int, congestion: str
) -> dict[str, Any]:
    """``n`` exchanges; the round trip of each, from its step's send to its first result."""
    source = (_second(host, 0), 0) if opt.route else None
    conns = [
        tcp_socket(opt, socket.create_connection((host, port), source_address=source), congestion)
        for _ in range(opt.copies)
    ]
    sel = selectors.DefaultSelector()
    for conn in conns:
        sel.register(conn, selectors.EVENT_READ, (conn, Frames()))
    rtts = []
    for seq in range(n):
        began = time.perf_counter()
        for conn in conns:
            conn.sendall(frame(seq, size))
        done = False
        while not done:
            for key, _ in sel.select():
                conn, frames = key.data
                data = conn.recv(65536)
                if not data:
                    raise SystemExit("the server closed a connection")
                if opt.quickack:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
                done = seq in list(frames.feed(data)) or done
        rtts.append((time.perf_counter() - began) * 1000)
    sent, states = Sent(), [tcp_state(conn) for conn in conns]
    for conn in conns:
        sent.add(tcp_sent(conn))
        conn.shutdown(socket.SHUT_WR)
    for conn in conns:  # the server reads its counters before its side closes
        while conn.recv(65536):
            pass
        conn.close()
    return {"rtts": rtts, "sent": asdict(sent), "tcp": states}


def _second(ip: str, side: int) -> str:
    """The route-rto address of a side (0 client, 1 server) in ip's subnet."""
    return ip.rsplit(".", 1)[0] + ROUTE_ADDRS[side]


def udp_send(sock: socket.socket, data: bytes, to: Any, copies: int, sent: Sent) -> None:
    for _ in range(copies):
        sock.sendto(data, to)
        sent.packets += 1
        sent.ip_bytes += len(data) + 28


def serve_udp(opt: Option, port: int) -> dict[str, Any]:
    """Answer a step once all its pieces came; answer again a step the client resends (its
    result was lost)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    print(json.dumps({"ready": port}), flush=True)
    pieces: dict[int, set[int]] = {}
    answered, answered_attempt, sent = -1, 0, Sent()
    while True:
        data, client = sock.recvfrom(65536)
        seq, piece, count, attempt = _DGRAM.unpack_from(data)
        if seq == BYE:
            sock.close()
            return {"sent": asdict(sent)}
        result = _DGRAM.pack(seq, 0, 1, attempt) + bytes(RESULT_BYTES - _DGRAM.size)
        if seq <= answered:
            if seq == answered and attempt > answered_attempt:  # the result was lost
                answered_attempt = attempt
                sent.resent += opt.copies
                udp_send(sock, result, client, opt.copies, sent)
            continue
        got = pieces.setdefault(seq, set())
        got.add(piece)
        if len(got) == count:
            answered, answered_attempt = seq, attempt
            pieces = {s: p for s, p in pieces.items() if s > seq}
            udp_send(sock, result, client, opt.copies, sent)


def call_udp(opt: Option, host: str, port: int, n: int, size: int) -> dict[str, Any]:
    """``n`` exchanges over datagrams: a step goes again, whole, after UDP_RESEND_FACTOR
    smoothed round trips (measured on steps answered without a resend) without its result,
    and 1.5 times later each further time."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    count = -(-size // DATAGRAM)
    rtts, sent, srtt = [], Sent(), 0.0
    for seq in range(n):
        began = time.perf_counter()
        attempt, wait = 0, UDP_FIRST_WAIT_S if not srtt else UDP_RESEND_FACTOR * srtt
        while True:
            for piece in range(count):
                body = min(DATAGRAM, size - piece * DATAGRAM)
                data = _DGRAM.pack(seq, piece, count, attempt) + bytes(body)
                udp_send(sock, data, (host, port), opt.copies, sent)
                sent.resent += opt.copies if attempt else 0
            if _result(sock, seq, time.perf_counter() + wait):
                break
            attempt, wait = attempt + 1, wait * 1.5
        rtt = time.perf_counter() - began
        if not attempt:
            srtt = rtt if not srtt else srtt + (rtt - srtt) / 8
        rtts.append(rtt * 1000)
    for _ in range(5):  # the server reports when this arrives; five make a loss unlikely
        sock.sendto(_DGRAM.pack(BYE, 0, 1, 0), (host, port))
    sock.close()
    return {"rtts": rtts, "sent": asdict(sent)}


def _result(sock: socket.socket, seq: int, deadline: float) -> bool:
    """Whether step ``seq``'s result arrives by ``deadline`` (older results are skipped)."""
    while (left := deadline - time.perf_counter()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return False
        if _DGRAM.unpack_from(data)[0] == seq:
            return True
    return False


def cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def peer(role: str, name: str, args: list[str]) -> None:
    """One side of one option, in its namespace: prints its results as one JSON line."""
    opt, before = OPTIONS[name], cpu_s()
    rt = realtime()  # a busy machine should delay the exchanges as little as the frames
    *args, congestion = args  # "" for the namespace's default
    if role == "serve":
        port = int(args[0])
        out = serve_udp(opt, port) if opt.udp else serve_tcp(opt, port, congestion)
    else:
        host, port, n, size = args[0], int(args[1]), int(args[2]), int(args[3])
        out = (
            call_udp(opt, host, port, n, size)
            if opt.udp
            else call_tcp(opt, host, port, n, size, congestion)
        )
    print(json.dumps({**out, "cpu_s": cpu_s() - before, "realtime": rt}), flush=True)


# --- the run: namespaces, the options at once, the table --------------------------------


@dataclass
class Result:
    """One option at one loss."""

    option: str
    loss: float
    """Per frame, per direction."""
    rtts_ms: list[float]
    """Round trips of the counted exchanges, in order."""
    sent: dict[str, int]
    """Both sides' Sent, added up."""
    cpu_s: float
    """Both processes' CPU."""
    tcp: dict[str, list[dict[str, int]]] = field(default_factory=dict)
    """Where each side's connections ended ("client", "server": tcp_state each)."""
    stats: dict[str, float] = field(default_factory=dict)
    """p50, p99 and max of ``rtts_ms`` (computed)."""

    def __post_init__(self) -> None:
        cuts = statistics.quantiles(self.rtts_ms, n=100)
        self.stats = {"p50": cuts[49], "p99": cuts[98], "max": max(self.rtts_ms)}


def remove_stale(prefix: str) -> list[str]:
    """Namespaces an earlier run that is gone left (and the processes in them)."""
    from lan import Lan

    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30
    ).stdout.split()
    stale = [
        ns
        for ns in listed
        if (m := re.fullmatch(rf"{prefix}(\d+)(sw|h\d+)", ns))
        and not Path(f"/proc/{m[1]}").exists()
    ]
    Lan([], prefix, list(stale)).destroy()
    return stale


def add_routes(wan: Any) -> None:
    """Second addresses on both hosts, and routes between them with ``rto_min``."""
    client, server = wan.hosts
    for host, side in ((client, 0), (server, 1)):
        mine, theirs = _second(host.ip, side), _second(host.ip, 1 - side)
        host.run("ip", "addr", "add", f"{mine}/32", "dev", "eth0")
        host.run(
            "ip", "route", "add", f"{theirs}/32", "dev", "eth0", "src", mine,
            "rto_min", f"{RTO_MIN_US // 1000}ms",
        )  # fmt: skip


def run_loss(wan: Any, names: list[str], loss: float, args: argparse.Namespace) -> list[Result]:
    """Every option at once over the link at ``loss``."""
    client, server = wan.hosts
    frames = wan.links(args.delay_ms, loss)
    me = str(Path(__file__).resolve())
    servers, clients = {}, {}
    for i, name in enumerate(names):
        port = str(BASE_PORT + i)
        proc = _spawn(server, sys.executable, me, "serve", name, port, args.congestion or "")
        assert proc.stdout is not None
        if "ready" not in proc.stdout.readline():
            raise RuntimeError(f"the {name} server did not start")
        servers[name] = proc
    size = HIDDEN * (4 if args.dtype == "f32" else 2) + RECORD_OVERHEAD
    n = WARMUP + args.exchanges
    for i, name in enumerate(names):
        ip = _second(server.ip, 1) if OPTIONS[name].route else server.ip
        port = str(BASE_PORT + i)
        argv = (me, "call", name, ip, port, str(n), str(size), args.congestion or "")
        clients[name] = _spawn(client, sys.executable, *argv)
    bound = n * args.delay_ms * 2 / 1000 * 3 + 120
    results = []
    for name in names:
        called = json.loads(clients[name].communicate(timeout=bound)[0].splitlines()[-1])
        served = json.loads(servers[name].communicate(timeout=60)[0].splitlines()[-1])
        sent = {k: called["sent"][k] + served["sent"][k] for k in called["sent"]}
        cpu = called["cpu_s"] + served["cpu_s"]
        tcp = {"client": called.get("tcp", []), "server": served.get("tcp", [])}
        results.append(Result(name, loss, called["rtts"][WARMUP:], sent, cpu, tcp))
    counts = wan.links(args.delay_ms, loss)
    lost = counts["lost"] - frames["lost"]
    print(f"  loss {loss:.1%}: {counts['forwarded'] - frames['forwarded']} frames "
          f"forwarded, {lost} lost", flush=True)  # fmt: skip
    return results


def _spawn(host: Any, *argv: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        host.argv(*argv), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    host.procs.append(proc)
    return proc


def table(results: list[Result], args: argparse.Namespace) -> str:
    rtt = 2 * args.delay_ms
    lossless = {r.option: r.stats["p99"] for r in results if r.loss == 0}
    head = (
        f"{'option':<12} {'loss':>5} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} "
        f"{'p99/0%':>6} {'>2RTT':>5} {'resent':>6} {'RTOs':>4} {'pkt/ex':>6} "
        f"{'B/ex':>6} {'cpu us/ex':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(results, key=lambda r: (r.loss, list(OPTIONS).index(r.option))):
        n = len(r.rtts_ms)
        late = sum(1 for x in r.rtts_ms if x > 3 * rtt)
        base = lossless.get(r.option)
        ratio = f"{r.stats['p99'] / base:.2f}x" if base and r.loss else ""
        lines.append(
            f"{r.option:<12} {r.loss:>5.1%} {r.stats['p50']:>7.1f} {r.stats['p99']:>7.1f} "
            f"{r.stats['max']:>7.1f} {ratio:>6} {late:>5} {r.sent['resent']:>6} "
            f"{r.sent['rtos']:>4} {r.sent['packets'] / n:>6.2f} {r.sent['ip_bytes'] / n:>6.0f} "
            f"{r.cpu_s / n * 1e6:>9.0f}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exchanges", type=int, default=2000, help="counted exchanges per row")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay of the link")
    ap.add_argument("--loss", type=float, default=0.01, help="loss per frame and direction")
    ap.add_argument("--dtype", choices=("f32", "f16"), default="f32", help="the row's type")
    ap.add_argument(
        "--congestion",
        help="TCP congestion control of every connection (default: the machine's, which a "
        "namespace starts with)",
    )
    ap.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS))
    ap.add_argument("--json", type=Path, help="write every round trip and count here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_loss needs root (network namespaces)", file=sys.stderr)
        return 2
    # The parent alone needs the namespaces' machinery (and kvasird, which bench_wan
    # imports): the peers start with the standard library only.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    from bench_wan import SUBNET, Stopped, Wan, cleaned_up
    from lan import Host, Lan

    began = time.monotonic()
    try:
        with cleaned_up():
            stale = remove_stale(PREFIX)
            if stale:
                print(f"removed what a killed run left: {' '.join(stale)}", flush=True)
            tag = f"{PREFIX}{os.getpid()}"
            wan = Wan(Lan([Host(f"{tag}h{i}", f"{SUBNET}.{i + 1}") for i in range(2)], tag))
            results: list[Result] = []
            try:
                wan._wire()
                add_routes(wan)
                congestion = (
                    args.congestion or wan.hosts[0].run("sysctl", "-n", CONGESTION).stdout.strip()
                )
                emulator = wan.itself(100)
                print(f"emulator: {emulator.text()}", flush=True)
                for loss in (0.0, args.loss):
                    results += run_loss(wan, args.options, loss, args)
            finally:
                wan.destroy()
    except (Stopped, KeyboardInterrupt):
        print("bench_loss: stopped; every namespace and process it made is removed",
              file=sys.stderr)  # fmt: skip
        return 1
    size = HIDDEN * (4 if args.dtype == "f32" else 2) + RECORD_OVERHEAD
    print(
        f"\n{args.exchanges} exchanges per row, a {size}-byte step ({args.dtype} row) and a "
        f"{RESULT_BYTES}-byte result, {args.delay_ms:g} ms one way (RTT {2 * args.delay_ms:g} "
        f"ms), TCP congestion control {congestion}; >2RTT: exchanges slower than "
        f"{6 * args.delay_ms:g} ms\n"
    )
    print(table(results, args))
    print()
    for opt in (OPTIONS[name] for name in args.options):
        print(f"  {opt.name:<12} {opt.text}")
    print(f"({time.monotonic() - began:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] in (["serve"], ["call"]):
        peer(sys.argv[1], sys.argv[2], sys.argv[3:])
    else:
        sys.exit(main())
