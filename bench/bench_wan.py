"""The bundled model's 3-stage ring across emulated WAN links: speculative decoding, first
tokens, lossy links and concurrent sessions.

    sudo .venv/bin/python bench/bench_wan.py [--quick] [--json PATH] [--tokens 64]
                                             [--prompts 6] [--pairs 12] [--rate-mbit 0]
                                             [--modes off lookup draft draft-batch] [--kernel-tcp]
                                             [--moe] [--settle-s 11] [--past-eos]
                                             [--delays 0 5 20 40] [--skip sessions ttft]

Needs root (network namespaces). Three daemons, each in a network namespace of its own
with its own home, joined by bootstrap address, hold a third of SmolLM2-135M's layers each
(``market.hold``; the first also the head, and it is the gateway). Every namespace is
joined to a bridge namespace where bench/wan_link.py forwards Ethernet frames between
them, holding each frame for the link's one-way delay and dropping it with the link's loss
probability (this kernel has no netem): a token crosses three links per circuit of the
ring (gateway -> stage 2 -> stage 3 -> gateway). The measuring client runs in the
gateway's namespace against its gateway on loopback, as an app on the gateway's machine
would, with the official openai client: greedy chat completions (temperature 0), streamed,
--tokens long (``ignore_eos``) or, for the editing requests, up to the answer's end
(ANSWER_ENDS; --past-eos: --tokens long too). The daemons pay nothing
(settlement off, as on a node for its operator's own use) and keep no prompt prefixes
(``prefix_cache`` off: every first token includes its whole prompt's prefill). TCP's slow
start after idle is off in every namespace, as ``kvasird service install`` sets it
(--kernel-tcp keeps the kernel's default, which costs the first token one or two round
trips a hop).

Rows: one-way delay per link 0 / 5 / 20 / 40 ms and 20 ms with 1 % loss, for every
``[inference] speculate`` setting (off; lookup, the context's own n-grams; draft, a draft
model run by the gateway), on two prompt sets: short questions, and editing requests
that quote the text their answer reuses (where prompt lookup finds its guesses). Per row:
time to first token (median), decode tok/s of one stream (median over the prompts, from
the first content chunk to the last), the gaps between content chunks (p50 / p99 / max),
and beside them the physical bound of decoding a token per circuit: one circuit is three
one-way delays plus the compute of a token at 0 ms (measured, speculation off), so a
bound of 1 / (t0 + 3d) tok/s and a first token no sooner than TTFT(0) + 3d. Then, on the
ring without speculation: 8 sessions at once at 20 ms, their aggregate tok/s over one
session's and the decode batches each hop ran meanwhile; and what 40 ms adds to the first
token, from questions each asked at 0 ms and right after at 40 ms (the machine's drift
cancels within a pair; each setting held --settle-s, 11 s, before its question; asked
after the lossless rows and before the lossy ones: SETTLE_S).
Before all, what the emulator itself adds: UDP round trips through
it at 0 ms against the same on a namespace's loopback. The closing line:

    wan: spec20 D.DDx, lookup20 D.DDx, ttft40 D.DDs, lossgap20 D.DDx, sessions8 D.DDx

spec20: tok/s with the draft model over without at 20 ms (questions); lookup20: the same
with lookup (editing requests); ttft40: TTFT at 40 ms minus at 0 ms (the pairs' median);
lossgap20: p99 gap with 1 % loss over without at 20 ms; sessions8: 8 sessions' aggregate
over one's. ``--modes ... draft-batch`` adds a ring whose hops check the draft's guesses as
one batch (``speculate_exact = false``), printed beside spec20. --quick (about 5 minutes)
runs 2 prompts a set, 24 tokens, 4 pairs, and each speculating ring only on the set the
closing line compares it on.

--moe runs the MoE ring instead: bench_scale's generated MoE (Qwen3-30B-A3B's shapes, 8
layers, Q4_K_M) on four hosts, two stages with the dense paths (the head on the first)
and two expert workers with half of every layer's experts each, at 0 / 5 / 20 ms a link,
speculation off. Two layouts: ``remote``, the stages hold no experts (every MoE layer's
rows cross to the workers and back); ``auto``, the stages also hold their layers' experts
as a fallback replica and choose per layer and step between it and the workers by
measured round trip and compute ([inference] expert_choice). Beside each row the bound:
a token a circuit, 1 / (t0 + (2 + 2 x layers sent out per token) x delay), t0 the
layout's own time a token at 0 ms; and what the stages chose (fallback, remote, cache),
per layer at 20 ms. Its closing line:

    wan-moe: auto20 D.DDx remote20, fallback20 D.DD

(auto20: the auto layout's tok/s over the remote one's at 20 ms; fallback20: the share of
its layer-steps at 20 ms computed on the stages' own copies.)

Namespaces are named ``kvwan<pid>...`` and addressed in 10.78.0.0/24; nothing touches the
host's own network. Every namespace, process and directory (``$TMPDIR/kvwan<pid>``, the
homes) the run makes is removed at its end, on SIGINT and SIGTERM too; a run removes what
a killed earlier one left.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))

from bench_swarm import LIVE_TIMING  # noqa: E402
from lan import Host, Lan  # noqa: E402
from netns import _run  # noqa: E402

from kvasird.daemon.init import init_home  # noqa: E402
from kvasird.home import Home  # noqa: E402
from kvasird.localnet.launcher import LOCAL_P2P  # noqa: E402
from kvasird.localnet.placement import pinned  # noqa: E402
from kvasird.model.bundled import bundled_path  # noqa: E402

EMULATOR = "userspace frame bridge, AF_PACKET (bench/wan_link.py; this kernel has no netem)"
SLOW_START_OFF = "net.ipv4.tcp_slow_start_after_idle=0"
"""What every namespace runs with unless --kernel-tcp: the setting of kvasird's sysctl
drop-in (kvasird service install). With the kernel's default (1) a hop's window shrinks
back to 10 packets between requests, and a prompt's rows wait one or two more round
trips a hop."""
PREFIX = "kvwan"
"""Every namespace this benchmark makes is named PREFIX + its process id + a role."""
SUBNET = "10.78.0"
WAN_LINK = Path(__file__).resolve().with_name("wan_link.py")
PLACEMENT = [["head", "layers:0-10"], ["layers:10-20"], ["layers:20-30"]]
MODES = ("off", "lookup", "draft")
"""``[inference] speculate`` of the gateway, one ring each."""
BATCHED = "draft-batch"
"""A further ring on request (--modes): the draft model's guesses checked as one batch at
every hop (``speculate_exact = false``: equal to float rounding, not token for token)."""
CONDITIONS = ((0.0, 0.0), (5.0, 0.0), (20.0, 0.0), (40.0, 0.0), (20.0, 0.01))
"""(one-way delay ms per link, loss fraction per link), a row each."""
HOPS = 3
"""Links a token crosses per circuit of the ring."""
GATEWAY = "http://127.0.0.1:8080"
"""The first daemon's gateway, on its namespace's own loopback."""
ADMIN = "http://127.0.0.1:5101"
"""Every daemon's admin API, on its namespace's own loopback."""
START_S = 240.0
"""Three daemons starting at once on a busy 2-core machine: a generous bound for serving."""
ECHO_PORT = 7777
SETTLE_S = 11.0
"""How long each TTFT pair's link setting holds before its question. A real link's round
trip does not jump from 0.1 to 80 ms between two requests; here it does, and BBR (the
kernel's congestion control here) sizes a connection's window by the least round trip of
the last 10 s. Asked right after the switch, the first chunks' links at 40 ms took 41 + 84
+ 76 ms; held 11 s, 41 + 57 + 41 ms in one run and 41 + 41 + 85 ms in the next, where
the pairs came after the rows with 1 % loss. Asked right after those rows they took 41 +
120 + 128 ms (ttft40 0.29 s): the lanes' windows, cut by the loss's retransmission
timeouts, regrow only as fast as a token's two packets let them. So the pairs run before
the lossy rows (41 + 41 + 41 ms, ttft40 0.11 s). The other way round, the pairs' switches
linger too: the lossy rows right after them (and after 8 sessions at 20 ms) gave
lossgap20 2.0x, against 0.95-1.06x right after the lossless rows. So the lossy rows run on a
fresh ring (docs/wan.md)."""
MOE_DELAYS = (0.0, 5.0, 20.0)
"""One-way delays per link of the MoE rows."""
MOE_HOPS = 2
"""Links a token crosses per circuit of the MoE ring (gateway -> stage 2 -> gateway)."""


def _experts(layers: range, lo: int, hi: int) -> list[str]:
    return [f"experts:{layer}:{lo}-{hi}" for layer in layers]


def moe_layouts(n_layer: int, n_expert: int) -> dict[str, list[list[str]]]:
    """The MoE ring's placements: stages without experts, and with a fallback replica."""
    half, every, a, b = n_expert // 2, range(n_layer), range(n_layer // 2), range(n_layer // 2,
                                                                                     n_layer)
    workers = [_experts(every, 0, half), _experts(every, half, n_expert)]
    return {
        "remote": [["head", f"layers:0-{n_layer // 2}"], [f"layers:{n_layer // 2}-{n_layer}"],
                   *workers],
        "auto": [["head", f"layers:0-{n_layer // 2}", *_experts(a, 0, n_expert)],
                 [f"layers:{n_layer // 2}-{n_layer}", *_experts(b, 0, n_expert)], *workers],
    }

QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do plants make their food?",
    "What causes the seasons on Earth?",
    "Explain what a computer network is.",
    "What is the difference between weather and climate?",
]
EDITS = [
    "Rewrite this function with `total` renamed to `acc`:\n```python\ndef sum_prices(items):\n"
    "    total = 0\n    for item in items:\n        total += item.price * item.quantity\n"
    "    return total\n```",
    'Fix the typo in: "The quick brown fox jumsp over the lazy dog, and the dog does not '
    'wake up because it is very tired after a long day of running in the sun."',
    "Add type hints to this function:\n```python\ndef greet(name, times):\n"
    "    for i in range(times):\n        print('Hello, ' + name + '!')\n"
    "    return len(name) * times\n```",
    'Rewrite this paragraph in the past tense: "Every morning the baker opens the shop at '
    "six. She bakes bread, sells it to the neighbours and talks with them about the "
    'weather. In the evening she cleans the ovens and walks home."',
    "Rename the variable `x` to `count` in this code:\n```javascript\nfunction countWords"
    "(text) {\n  let x = 0;\n  for (const word of text.split(' ')) {\n    if (word.length"
    " > 0) {\n      x += 1;\n    }\n  }\n  return x;\n}\n```",
    'Fix the spelling mistakes in: "Teh meeting is schedulled for tomorow at ten, in the '
    'big room on the second floor; please bring your notes and the reprot from last week."',
]
PROMPT_SETS = {"questions": QUESTIONS, "edits": EDITS}
ANSWER_ENDS = ("edits",)
"""Prompt sets whose generations end with the answer (at the model's end of turn, or
--tokens), as an editing request's does; the others run --tokens long (ignore_eos). Past
its answer the bundled model writes another conversation turn, which quotes nothing (three
of the six edits end after 35, 43 and 60 tokens): --past-eos measures the edits that way
too."""
QUICK_SETS = {
    "off": ("questions", "edits"),
    "lookup": ("edits",),
    "draft": ("questions",),
    BATCHED: ("questions",),
}
"""With --quick, each ring runs only the prompt sets the closing line compares it on."""


class Stopped(Exception):
    """SIGTERM: leave through the cleanup, as on Ctrl-C."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stopped(f"signal {signum}")


# --- the WAN: namespaces, veths, the frame bridge ---------------------------------------


@dataclass
class Wan:
    """Namespaces joined by the userspace bridge; ``destroy`` removes all of it."""

    lan: Lan
    """The hosts (one namespace each) and, as its switch, the bridge's namespace."""
    bridge: subprocess.Popen[str] | None = None
    """wan_link.py bridge, reading link settings on its stdin."""
    realtime: bool = False
    """Whether the bridge runs at real-time priority (wan_link.realtime)."""
    kernel_tcp: bool = False
    """Leave the kernel's TCP slow start after idle on in every namespace (else it is off,
    as ``kvasird service install``'s sysctl drop-in sets it)."""
    cc: str = ""
    """TCP congestion control in the namespaces (the kernel's default, as read)."""

    @classmethod
    def create(cls, n: int, kernel_tcp: bool = False) -> Wan:
        tag = f"{PREFIX}{os.getpid()}"
        wan = cls(Lan([Host(f"{tag}h{i}", f"{SUBNET}.{i + 1}") for i in range(n)], tag))
        wan.kernel_tcp = kernel_tcp
        try:
            wan._wire()
        except BaseException:
            wan.destroy()
            raise
        return wan

    @property
    def hosts(self) -> list[Host]:
        return self.lan.hosts

    def _wire(self) -> None:
        sw = self.lan.switch
        for ns in (sw, *(h.ns for h in self.hosts)):
            _run("ip", "netns", "add", ns)
            self.lan.made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(*f"ip netns exec {ns} sysctl -q -w net.ipv6.conf.all.disable_ipv6=1".split())
            if not self.kernel_tcp:
                _run(*f"ip netns exec {ns} sysctl -q -w {SLOW_START_OFF}".split())
        self.cc = subprocess.run(
            ["ip", "netns", "exec", sw, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        for i, host in enumerate(self.hosts):
            # Made in the host's namespace, its peer moved straight into the bridge's.
            _run(*f"ip -n {host.ns} link add eth0 type veth peer name p{i} netns {sw}".split())
            _run("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
            _run("ip", "-n", sw, "link", "set", f"p{i}", "up")
            host.run(sys.executable, str(WAN_LINK), "plain", "eth0")
        ports = [f"p{i}" for i in range(len(self.hosts))]
        self.bridge = subprocess.Popen(
            Host(sw, "").argv(sys.executable, str(WAN_LINK), "bridge", *ports),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.bridge.stdout is not None
        line = self.bridge.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"the frame bridge did not start: {line!r}")
        self.realtime = json.loads(line)["realtime"]

    def links(self, delay_ms: float, loss: float, rate_mbit: float = 0.0) -> dict[str, int]:
        """Set every link; the bridge's frame counts so far."""
        assert self.bridge is not None and self.bridge.stdin and self.bridge.stdout
        line = {"default": {"delay_ms": delay_ms, "loss": loss, "rate_mbit": rate_mbit}}
        self.bridge.stdin.write(json.dumps(line) + "\n")
        self.bridge.stdin.flush()
        counts: dict[str, int] = json.loads(self.bridge.stdout.readline())
        return counts

    def itself(self, n: int = 200) -> Emulator:
        """What the bridge adds at 0 ms."""
        self.links(0.0, 0.0)
        self.round_trips(10)  # addresses resolved (ARP), the bridge's MAC table learned
        return Emulator(self.round_trips(n), self.round_trips(n, loopback=True), self.realtime)

    def round_trips(self, n: int, loopback: bool = False) -> list[float]:
        """Milliseconds of ``n`` UDP round trips from host 0 to host 1 through the bridge, or
        (``loopback``) on host 1's own loopback: the kernel's part of them. A lost one is
        left out, after waiting 2 s for it."""
        a, b = self.hosts[0], self.hosts[1]
        echo = subprocess.Popen(
            b.argv(sys.executable, str(WAN_LINK), "echo", str(ECHO_PORT)),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        b.procs.append(echo)
        try:
            assert echo.stdout is not None
            echo.stdout.readline()  # it listens
            src, ip = (b, "127.0.0.1") if loopback else (a, b.ip)
            argv = (sys.executable, str(WAN_LINK), "ping", ip, str(ECHO_PORT), str(n))
            times: list[float] = json.loads(src.run(*argv, timeout=60 + 3 * n).stdout)
            return times
        finally:
            echo.kill()
            echo.wait()
            b.procs.remove(echo)

    def destroy(self) -> None:
        if self.bridge is not None and self.bridge.poll() is None:
            assert self.bridge.stdin is not None
            self.bridge.stdin.close()  # the bridge exits when its stdin closes
            try:
                self.bridge.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.bridge.pid, signal.SIGKILL)
                self.bridge.wait()
        self.lan.destroy()


@dataclass(frozen=True)
class Emulator:
    """The emulator's own cost, measured at 0 ms."""

    through_ms: list[float]
    """UDP round trips between two namespaces through the bridge."""
    loopback_ms: list[float]
    """The same on one namespace's loopback: the kernel's and Python's part."""
    realtime: bool
    """Whether the bridge ran at real-time priority."""

    def text(self) -> str:
        through, loop = statistics.median(self.through_ms), statistics.median(self.loopback_ms)
        return (
            f"UDP round trip between two namespaces through it at 0 ms: median "
            f"{through:.3f} ms (p99 {_pct(sorted(self.through_ms), 99):.3f}); on a "
            f"namespace's loopback {loop:.3f} ms: the emulator adds about "
            f"{(through - loop) / 2:.3f} ms a crossing (a circuit of the ring crosses "
            f"{HOPS}); the bridge ran at "
            + ("real-time priority" if self.realtime else "normal priority")
        )


def remove_stale() -> list[str]:
    """Remove what earlier runs that are gone left: their namespaces (and the processes in
    them) and their directories (the daemons' homes, with their shards)."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30
    ).stdout.split()
    names = [ns for ns in listed if re.fullmatch(rf"{PREFIX}\d+(sw|h\d+)", ns)]
    dirs = [
        d
        for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*")
        if re.fullmatch(rf"{PREFIX}\d+", d.name)
    ]
    stale = [ns for ns in names if not _running(ns)]
    if stale:
        Lan([], PREFIX, list(stale)).destroy()  # which empties its list
    for d in dirs:
        if not _running(d.name):
            shutil.rmtree(d, ignore_errors=True)
            stale.append(str(d))
    return stale


def _running(name: str) -> bool:
    """Whether the process that named ``name`` (PREFIX, its process id, maybe a role) is
    another one, still alive (a run, or a test of the bridge)."""
    pid = int(re.match(rf"{PREFIX}(\d+)", name)[1])  # type: ignore[index]
    return pid != os.getpid() and Path(f"/proc/{pid}").exists()


# --- the ring: three daemons, one per namespace -----------------------------------------


@dataclass
class Ring:
    """Three daemons on the WAN's hosts, the first also the gateway."""

    wan: Wan
    """Where the daemons run."""
    root: Path
    """Their homes and logs."""
    mode: str
    """``[inference] speculate`` on the gateway."""
    procs: list[subprocess.Popen[bytes]]
    """The daemons, node i on host i."""
    logs: list[Path]
    """Their output."""
    client: Client
    """The measuring client on the gateway's host."""

    @classmethod
    def start(
        cls,
        wan: Wan,
        root: Path,
        mode: str,
        model: Path,
        placement: list[list[str]] = PLACEMENT,
        name: str = "",
        extra: dict[str, Any] | None = None,
    ) -> Ring:
        """Node i holds placement[i] on host i; `extra` settings on every node; `name`
        the ring's directory (its mode's by default)."""
        bootstrap: list[str] = []
        procs, logs = [], []
        name = name or mode
        client = Client.start(wan.hosts[0])  # its imports meanwhile
        for i, (host, pins) in enumerate(zip(wan.hosts, placement, strict=False)):
            home = Home(root / name / f"node{i}")
            drafts = mode in ("draft", BATCHED)
            speculation = {
                "inference.speculate": ("draft" if drafts else mode) if i == 0 else "off",
                "inference.draft_model": str(model) if i == 0 and drafts else "",
                "inference.draft_k": 0,
                "inference.speculate_exact": mode != BATCHED,
            }
            values = {
                **LOCAL_P2P,
                **pinned(model, pins),
                **LIVE_TIMING,
                **speculation,
                "node.network": "wan",
                "p2p.listen": [f"/ip4/{host.ip}/tcp/4001"],
                "p2p.bootstrap": bootstrap,
                "inference.prefix_cache": False,
                **(extra or {}),
            }
            peer = init_home(home, values)
            bootstrap = [f"/ip4/{host.ip}/tcp/4001/p2p/{peer}"]
            logs.append(root / name / f"node{i}.log")
            procs.append(
                host.spawn(
                    sys.executable,
                    "-m",
                    "kvasird",
                    "--home",
                    str(home.root),
                    "run",
                    log=logs[-1],
                    env={"PYTHONUNBUFFERED": "1"},
                )
            )
        ring = cls(wan, root, mode, procs, logs, client)
        try:
            ring.wait_serving()
        except BaseException:
            ring.stop()
            raise
        return ring

    def admin(self, i: int, path: str) -> Any:
        code = (
            "import httpx, json, sys\nprint(json.dumps(httpx.get(sys.argv[1], timeout=10).json()))"
        )
        return self.wan.hosts[i].python(code, ADMIN + path, timeout=60)

    def measured_at(self, delay_ms: float, timeout_s: float = 30.0) -> bool:
        """Wait until the gateway's heartbeat round trips to every peer say the links are
        `delay_ms` apart (its route choices, fast start among them, follow those); False
        where they did not within `timeout_s` (a busy machine)."""
        want = 2 * delay_ms
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rtts = [p.get("rtt_ms") for p in self.admin(0, "/v0/peers")]
            if rtts and all(r is not None and abs(r - want) <= max(5.0, want / 4) for r in rtts):
                return True
            time.sleep(0.5)
        return False

    def wait_serving(self) -> None:
        """Until a generation through the gateway answers and every hop is on a lane."""
        deadline = time.monotonic() + START_S
        while True:
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"node {dead[0]} exited; its log:\n{self.tail(dead[0])}")
            try:
                self.client.measure("questions", [0], 4)
                views = [self.admin(i, "/v0/inference") for i in range(len(self.procs))]
                drafting = views[0].get("speculation", {}).get("draft_model")
                if not any(v["lanes"]["libp2p_to"] for v in views) and (
                    drafting or self.mode not in ("draft", BATCHED)
                ):
                    return
            except (ClientError, AssertionError, json.JSONDecodeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the ring did not serve within {START_S:g} s; its "
                    f"gateway's log:\n{self.tail(0)}"
                )
            time.sleep(1.0)

    def speculation(self) -> str:
        """What the gateway says of its speculation: its mode, draft model, why it is off,
        and what it measured per draft source (acceptance, the k it would choose)."""
        view = self.admin(0, "/v0/inference").get("speculation", {})
        said = [
            f"{k} {view[k]}" for k in ("mode", "draft_model", "off_because", "steps") if view.get(k)
        ]
        said += [f"{name}: {json.dumps(e)}" for name, e in view.get("sources", {}).items()]
        return ", ".join(said)

    def batches(self) -> list[int]:
        """Decode batches each hop has run so far."""
        return [
            self.admin(i, "/v0/inference")["serving"]["batches"]["batches"]
            for i in range(len(self.procs))
        ]

    def choices(self, stages: int = 2) -> dict[int, dict[str, int]]:
        """Per MoE layer, the steps the stages computed its experts each way so far."""
        out: dict[int, dict[str, int]] = {}
        for i in range(stages):
            for layer, counts in self.admin(i, "/v0/inference")["expert_choice"]["layers"].items():
                mine = out.setdefault(int(layer), {})
                for how, n in counts.items():
                    mine[how] = mine.get(how, 0) + n
        return out

    def tail(self, i: int, lines: int = 30) -> str:
        try:
            return "\n".join(self.logs[i].read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        self.client.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, host in zip(self.procs, self.wan.hosts, strict=False):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            host.procs.remove(proc)


# --- the measuring client, run inside the gateway's namespace ---------------------------


@dataclass
class Client:
    """This script's ``client`` command on a host, measuring on request: one JSON line in
    (``measure``'s arguments), one out (its result, or ``{"error": ...}``)."""

    host: Host
    """The gateway's host, whose loopback the client reaches the gateway on."""
    proc: subprocess.Popen[str]
    """The ``client`` command, its stdin and stdout piped."""

    @classmethod
    def start(cls, host: Host) -> Client:
        proc = subprocess.Popen(
            host.argv(sys.executable, str(Path(__file__).resolve()), "client"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        host.procs.append(proc)
        return cls(host, proc)

    def measure(
        self,
        prompts: str,
        picks: list[int],
        tokens: int,
        together: bool = False,
        past_eos: bool = False,
    ) -> dict[str, Any]:
        """``measure`` on the host; raises with the client's error."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([prompts, picks, tokens, together, past_eos]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client on {self.host.ns} exited ({self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise ClientError(out["error"])
        return out

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # it exits when its stdin closes
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.host.procs.remove(self.proc)


class ClientError(Exception):
    """A measuring request failed at the gateway (the ring not serving yet, or a failure)."""


def serve_client() -> None:
    """The ``client`` command: ``measure`` for each request line on stdin."""
    for line in sys.stdin:
        try:
            out = measure(*json.loads(line))
        except Exception as exc:  # noqa: BLE001 - said to the bench, which decides
            out = {"error": repr(exc)}
        print(json.dumps(out), flush=True)


def measure(
    prompts: str, picks: list[int], tokens: int, together: bool, past_eos: bool = False
) -> dict[str, Any]:
    """Greedy streamed chat completions through the gateway of the prompts ``picks`` of a
    set (their indices, taken modulo the set's size): one after another, or all at once
    (``together``, a session each); ``tokens`` long (ignore_eos), or up to the answer's end
    for a set of ANSWER_ENDS unless ``past_eos``. Per generation the arrival times of its
    content chunks and of its finish after its request was sent, and its completion
    tokens; and the seconds from the first
    request to the last answer's end; and what the gateway's speculation guessed and the
    route accepted meanwhile (its admin API's counters)."""
    import httpx
    from openai import OpenAI

    api = OpenAI(base_url=GATEWAY + "/v1", api_key="local", max_retries=0, timeout=600)
    model = api.models.list().data[0].id
    texts = PROMPT_SETS[prompts]

    def one(prompt: str) -> dict[str, Any]:
        began = time.perf_counter()
        stamps: list[float] = []
        used, end = 0, None
        stream = api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": past_eos or prompts not in ANSWER_ENDS},
        )
        for chunk in stream:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter() - began)
            if chunk.choices and chunk.choices[0].finish_reason and end is None:
                end = time.perf_counter() - began
        return {"stamps": stamps, "tokens": used, "end": end}

    def speculation() -> dict[str, int]:
        view = httpx.get(ADMIN + "/v0/inference", timeout=10).json().get("speculation", {})
        return {k: int(view.get(k, 0)) for k in ("guessed", "accepted")}

    before = speculation()
    began = time.perf_counter()
    if not together:
        runs = [one(texts[i % len(texts)]) for i in picks]
    else:
        runs = [{} for _ in picks]

        def run(i: int) -> None:
            runs[i] = one(texts[picks[i] % len(texts)])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(picks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not all(runs):
            raise ClientError("a concurrent session failed (see the gateway's log)")
    seconds = time.perf_counter() - began
    after = speculation()
    return {"runs": runs, "seconds": seconds, **{k: after[k] - before[k] for k in after}}


# --- rows -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One ring, one link condition, one prompt set."""

    mode: str
    """``speculate`` on the gateway."""
    prompts: str
    """Which prompt set."""
    delay_ms: float
    """One-way delay per link."""
    loss: float
    """Loss fraction per link."""
    ttft_s: float
    """Median time to the first content chunk."""
    tok_s: float
    """Median over the prompts of one stream's decode tok/s (first to last content chunk)."""
    gap_p50_ms: float
    """Median gap between content chunks, all generations of the row pooled."""
    gap_p99_ms: float
    """99th percentile of those gaps: the stalls a reader sees."""
    gap_max_ms: float
    """The longest of those gaps."""
    lost_frames: int
    """Frames the links lost during the row."""
    guessed: int
    """Tokens the gateway's speculation guessed during the row."""
    accepted: int
    """Of those, the tokens the route accepted."""

    @classmethod
    def of(
        cls,
        mode: str,
        prompts: str,
        delay_ms: float,
        loss: float,
        measured: dict[str, Any],
        lost: int,
    ) -> Row:
        runs = [r for r in measured["runs"] if len(r["stamps"]) > 1]
        if not runs:
            raise RuntimeError(f"no generation streamed tokens: {measured}")
        gaps = sorted(
            b - a for r in runs for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)
        )
        rates = [(r["tokens"] - 1) / (_end(r) - r["stamps"][0]) for r in runs]
        return cls(
            mode,
            prompts,
            delay_ms,
            loss,
            statistics.median(r["stamps"][0] for r in runs),
            statistics.median(rates),
            _pct(gaps, 50) * 1000,
            _pct(gaps, 99) * 1000,
            gaps[-1] * 1000,
            lost,
            measured["guessed"],
            measured["accepted"],
        )


def _pct(sorted_values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of sorted values."""
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def find(
    rows: list[Row], mode: str, prompts: str, delay_ms: float, loss: float = 0.0
) -> Row | None:
    return next(
        (
            r
            for r in rows
            if (r.mode, r.prompts, r.delay_ms, r.loss) == (mode, prompts, delay_ms, loss)
        ),
        None,
    )


def compare(a: Row | None, b: Row | None, field: str, ratio: bool = True) -> float:
    """a's ``field`` over b's (or minus, without ``ratio``); nan where either did not run."""
    if a is None or b is None:
        return math.nan
    x, y = getattr(a, field), getattr(b, field)
    return float(x / y if ratio else x - y)


def run_ring(wan: Wan, ring: Ring, args: argparse.Namespace, lossy: bool) -> list[Row]:
    """The link conditions without loss (or with, `lossy`) on one ring: every prompt set
    (with --quick, those the closing line compares this ring on)."""
    rows = []
    for delay, loss in CONDITIONS:
        if args.delays is not None and delay not in args.delays or (loss > 0) != lossy:
            continue
        wan.links(delay, loss, args.rate_mbit)
        if not ring.measured_at(delay):
            print(f"  (the gateway's round trips did not settle at {delay:g} ms)", flush=True)
        ring.client.measure("questions", [0], 4)  # the route re-measured at this delay
        for prompts in QUICK_SETS[ring.mode] if args.quick else PROMPT_SETS:
            before = wan.links(delay, loss, args.rate_mbit)["lost"]
            measured = ring.client.measure(
                prompts, list(range(args.prompts)), args.tokens, past_eos=args.past_eos
            )
            lost = wan.links(delay, loss, args.rate_mbit)["lost"] - before
            rows.append(Row.of(ring.mode, prompts, delay, loss, measured, lost))
            print(f"  {_row_text(rows[-1])}", flush=True)
    return rows


def _end(run: dict[str, Any]) -> float:
    """When a generation ended: its finish chunk (after its last token, the end of turn
    included), else its last content chunk."""
    end = run.get("end")
    return float(end) if end is not None else float(run["stamps"][-1])


def _row_text(r: Row) -> str:
    return (
        f"{r.mode} {r.prompts} {r.delay_ms:g} ms {r.loss * 100:g} % loss: TTFT "
        f"{r.ttft_s:.2f} s, {r.tok_s:.1f} tok/s"
    )


@dataclass(frozen=True)
class Sessions:
    """Concurrent sessions on the ring without speculation, at one link delay."""

    delay_ms: float
    """One-way delay per link."""
    one_tok_s: float
    """One session's tokens over its wall time."""
    many: int
    """Sessions at once."""
    many_tok_s: float
    """All sessions' tokens over the wall time of all of them."""
    batches: list[int]
    """Decode batches each hop ran during the concurrent run."""


def sessions(
    wan: Wan, ring: Ring, args: argparse.Namespace, delay_ms: float = 20.0, many: int = 8
) -> Sessions:
    wan.links(delay_ms, 0.0, args.rate_mbit)
    ring.client.measure("questions", [0], 4)

    def aggregate(k: int) -> float:
        measured = ring.client.measure("questions", list(range(k)), args.tokens, together=True)
        return float(sum(r["tokens"] for r in measured["runs"]) / measured["seconds"])

    one = aggregate(1)
    before = ring.batches()
    together = aggregate(many)
    after = ring.batches()
    return Sessions(
        delay_ms, one, many, together, [b - a for a, b in zip(before, after, strict=True)]
    )


@dataclass(frozen=True)
class Paired:
    """First tokens at 0 ms and at another delay, each prompt asked at one and then at the
    other, the links switched between: the machine's drift (a shared machine's prompt
    compute varies by more than the delay) cancels within each pair."""

    delay_ms: float
    """One-way delay per link of the pairs' second halves."""
    zero_s: list[float]
    """TTFT of each pair's first half, at 0 ms."""
    delayed_s: list[float]
    """TTFT of each pair's second half, at ``delay_ms``."""
    chunks: dict[float, list[dict[str, Any]]] = field(default_factory=dict)
    """Delay -> the gateway's trace of each first prompt chunk at it, where the route was
    opened by the chunk (``/v0/inference`` first_chunk.last): where the time went."""

    def chunk_text(self, delay: float) -> str:
        """The traced first chunks' medians at `delay`: the whole, each hop, the wire."""
        got = [c for c in self.chunks.get(delay, []) if c]
        if not got:
            return f"at {delay:g} ms: no first chunk traced (the route was opened before it)"
        hops = [
            statistics.median(c["hops_ms"][i] for c in got) for i in range(len(got[0]["hops_ms"]))
        ]
        links = [
            statistics.median(c["links_ms"][i] for c in got)
            for i in range(min(len(c.get("links_ms", ())) for c in got))
        ]
        return (
            f"at {delay:g} ms: {statistics.median(c['total_ms'] for c in got):.1f} ms, hops "
            + " + ".join(f"{h:.1f}" for h in hops)
            + f", wire {statistics.median(c['wire_ms'] for c in got):.1f} ms"
            + (" (links " + " + ".join(f"{x:.1f}" for x in links) + ")" if links else "")
            + f" ({len(got)} chunks)"
        )

    def difference(self) -> float:
        """The median of the pairs' differences."""
        return statistics.median(d - z for z, d in zip(self.zero_s, self.delayed_s, strict=True))


def paired_ttft(
    wan: Wan, ring: Ring, pairs: int, delay_ms: float = 40.0, settle_s: float = SETTLE_S
) -> Paired:
    zero: list[float] = []
    delayed: list[float] = []
    chunks: dict[float, list[dict[str, Any]]] = {}
    last: dict[str, Any] = {}
    for i in range(pairs):
        for delay, into in ((0.0, zero), (delay_ms, delayed)):
            wan.links(delay, 0.0)
            switched = time.monotonic()
            # as before each row: the gateway's view of its route taken at this delay (a
            # first token right after the change would open the way a near route does)
            ring.measured_at(delay)
            ring.client.measure("questions", [i + 1], 1)
            time.sleep(max(0.0, settle_s - (time.monotonic() - switched)))
            into.append(ring.client.measure("questions", [i], 1)["runs"][0]["stamps"][0])
            first = ring.admin(0, "/v0/inference").get("first_chunk", {}).get("last", {})
            chunks.setdefault(delay, []).append(first if first != last else {})
            last = first
    return Paired(delay_ms, zero, delayed, chunks)


@dataclass(frozen=True)
class MoeRow:
    """One MoE layout at one link delay."""

    layout: str
    """``remote`` (stages without experts) or ``auto`` (with a fallback replica)."""
    row: Row
    """Its measurements (speculation off, the questions)."""
    chose: dict[int, dict[str, int]]
    """Per layer, the steps its experts were computed each way during the row."""

    def remote_layers(self) -> float:
        """MoE layers sent to the workers per token (each a round trip)."""
        steps = sum(sum(c.values()) for c in self.chose.values()) / max(len(self.chose), 1)
        sent = sum(c.get("remote", 0) for c in self.chose.values())
        return sent / steps if steps else 0.0

    def share(self, how: str) -> float:
        total = sum(sum(c.values()) for c in self.chose.values())
        return sum(c.get(how, 0) for c in self.chose.values()) / total if total else math.nan


def run_moe(wan: Wan, root: Path, args: argparse.Namespace) -> list[MoeRow]:
    """Both MoE layouts at every MOE_DELAYS delay."""
    from kvasird_dev.benchmodels import SPECS, bench_model

    spec = SPECS["moe"]
    model = bench_model(Path(__file__).resolve().parents[1] / ".cache", "moe")
    tokens, prompts = min(args.tokens, 32), min(args.prompts, 3)
    out: list[MoeRow] = []
    for layout, placement in moe_layouts(spec.n_layer, spec.n_expert).items():
        print(f"MoE ring, {layout} ...", flush=True)
        ring = Ring.start(wan, root, "off", model, placement, f"moe-{layout}",
                          {"inference.expert_choice": "auto", "inference.step_timeout_s": 60.0})
        try:
            for delay in MOE_DELAYS:
                wan.links(delay, 0.0, args.rate_mbit)
                if not ring.measured_at(delay):
                    print(f"  (the round trips did not settle at {delay:g} ms)", flush=True)
                ring.client.measure("questions", [0], 4)
                before = ring.choices()
                measured = ring.client.measure("questions", list(range(prompts)), tokens)
                after = ring.choices()
                chose = {
                    layer: {how: n - before.get(layer, {}).get(how, 0) for how, n in c.items()}
                    for layer, c in after.items()
                }
                row = Row.of(f"moe-{layout}", "questions", delay, 0.0, measured, 0)
                out.append(MoeRow(layout, row, chose))
                print(f"  {_row_text(row)}; remote layers a token "
                      f"{out[-1].remote_layers():.1f}", flush=True)
        finally:
            ring.stop()
    return out


def report_moe(rows: list[MoeRow]) -> dict[str, float]:
    print("\n# The MoE ring across emulated WAN links (bench_scale's MoE: Qwen3-30B-A3B "
          "shapes, 8 layers, Q4_K_M; 2 stages, 2 expert workers)\n")
    print(f"bound: a token a circuit, 1 / (t0 + ({MOE_HOPS} + 2 x layers sent out a token) x "
          "delay), t0 the layout's time a token at 0 ms\n")
    print("| layout | delay ms | TTFT s | tok/s | bound tok/s | of bound | gaps p50 / p99 / max ms "
          "| layers sent out a token | fallback / remote / cache |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in rows:
        zero = next(z for z in rows if z.layout == m.layout and z.row.delay_ms == 0.0)
        t0, r = 1 / zero.row.tok_s, m.row
        bound = 1 / (t0 + (MOE_HOPS + 2 * m.remote_layers()) * r.delay_ms / 1000)
        shares = " / ".join(f"{m.share(h) * 100:.0f} %" for h in ("fallback", "remote", "cache"))
        print(f"| {m.layout} | {r.delay_ms:g} | {r.ttft_s:.3f} | {r.tok_s:.1f} | {bound:.1f} | "
              f"{r.tok_s / bound:.2f} | {r.gap_p50_ms:.1f} / {r.gap_p99_ms:.1f} / "
              f"{r.gap_max_ms:.1f} | {m.remote_layers():.1f} | {shares} |")
    at20 = {m.layout: m for m in rows if m.row.delay_ms == 20.0}
    for m in at20.values():
        print(f"\n{m.layout} at 20 ms, per layer (steps: fallback / remote / cache): "
              + ", ".join(f"{layer}: {c.get('fallback', 0)} / {c.get('remote', 0)} / "
                          f"{c.get('cache', 0)}" for layer, c in sorted(m.chose.items())))
    summary = {
        "auto20": at20["auto"].row.tok_s / at20["remote"].row.tok_s
        if {"auto", "remote"} <= at20.keys() else math.nan,
        "fallback20": at20["auto"].share("fallback") if "auto" in at20 else math.nan,
    }
    print(f"\nwan-moe: auto20 {summary['auto20']:.2f}x remote20, "
          f"fallback20 {summary['fallback20']:.2f}")
    return summary


# --- report -----------------------------------------------------------------------------


def report(
    rows: list[Row],
    crowd: Sessions | None,
    ttft: Paired | None,
    emulator: Emulator,
    frames: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, float]:
    print(
        f"\n# The bundled model's 3-stage ring across emulated WAN links\n\nemulator: "
        f"{EMULATOR}\n{emulator.text()}\nframes through it in all: {frames['forwarded']} "
        f"forwarded, {frames['lost']} lost (the loss rows), {frames['dropped']} dropped on "
        f"full queues, {frames['unsent']} refused by a port\nTCP slow start after idle: "
        f"{'the kernel default (on)' if args.kernel_tcp else 'off (' + SLOW_START_OFF + ')'}"
        f"; congestion control {args.cc_used}"
    )
    print(
        f"greedy, {args.tokens} tokens a generation (ignore_eos"
        + (")" if args.past_eos else f"; the {', '.join(ANSWER_ENDS)} up to the answer's end)")
        + f", {args.prompts} prompts a set, 1 compute thread a daemon; draft model: the "
        "bundled model itself (the model drafting for itself: the upper bound of the "
        "mechanism, every guess right)"
    )
    if args.rate_mbit:
        print(f"every link paced to {args.rate_mbit:g} Mbit/s")
    for prompts in PROMPT_SETS:
        base = find(rows, "off", prompts, 0.0)
        if base is None:
            continue
        t0 = 1 / base.tok_s
        print(
            f"\n## {prompts} (bound: a token a circuit, 1 / ({t0 * 1000:.1f} ms + "
            f"{HOPS} x delay); TTFT bound: TTFT(0) + {HOPS} x delay)\n"
        )
        print(
            "| delay ms | loss | speculate | TTFT s | TTFT bound s | tok/s | bound tok/s | "
            "of bound | gaps p50 / p99 / max ms | accepted / guessed | frames lost |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r.prompts == prompts):
            zero = find(rows, r.mode, prompts, 0.0)
            assert zero is not None  # every ring runs 0 ms first
            bound = 1 / (t0 + HOPS * r.delay_ms / 1000)
            print(
                f"| {r.delay_ms:g} | {r.loss * 100:g} % | {r.mode} | {r.ttft_s:.3f} | "
                f"{zero.ttft_s + HOPS * r.delay_ms / 1000:.3f} | {r.tok_s:.1f} | {bound:.1f} | "
                f"{r.tok_s / bound:.2f} | {r.gap_p50_ms:.1f} / {r.gap_p99_ms:.1f} / "
                f"{r.gap_max_ms:.1f} | {r.accepted} / {r.guessed} | {r.lost_frames} |"
            )
    off20 = find(rows, "off", "questions", 20.0)
    summary = {
        "spec20": compare(find(rows, "draft", "questions", 20.0), off20, "tok_s"),
        "spec20_batch": compare(find(rows, BATCHED, "questions", 20.0), off20, "tok_s"),
        "lookup20": compare(
            find(rows, "lookup", "edits", 20.0), find(rows, "off", "edits", 20.0), "tok_s"
        ),
        "ttft40": ttft.difference() if ttft else math.nan,
        "lossgap20": compare(find(rows, "off", "questions", 20.0, 0.01), off20, "gap_p99_ms"),
        "sessions8": crowd.many_tok_s / crowd.one_tok_s if crowd else math.nan,
    }
    if ttft:
        print(
            f"\nfirst token at {ttft.delay_ms:g} ms minus at 0 ms, {len(ttft.zero_s)} "
            f"questions each asked at both (1 token): median {summary['ttft40']:.3f} s "
            f"(the bound: {HOPS} x {ttft.delay_ms:g} ms = {HOPS * ttft.delay_ms / 1000:.3f} s); "
            f"TTFT at 0 ms median {statistics.median(ttft.zero_s):.3f} s, at "
            f"{ttft.delay_ms:g} ms {statistics.median(ttft.delayed_s):.3f} s"
        )
        print(
            "first prompt chunks as the gateway traced them, medians: "
            + "; ".join(ttft.chunk_text(d) for d in (0.0, ttft.delay_ms))
        )
    if crowd:
        print(
            f"\n## {crowd.many} sessions at once, {crowd.delay_ms:g} ms a link, speculation off\n"
        )
        print(
            f"one session: {crowd.one_tok_s:.1f} tok/s; {crowd.many} sessions: "
            f"{crowd.many_tok_s:.1f} tok/s aggregate ({summary['sessions8']:.2f}x)"
        )
        print(
            "decode batches per hop meanwhile: "
            + ", ".join(f"node{i} {b}" for i, b in enumerate(crowd.batches))
        )
        print(f"batches > 0 at every hop: {'yes' if all(crowd.batches) else 'no'}")
    if not math.isnan(summary["spec20_batch"]):
        print(
            f"\nwith the draft's guesses checked as one batch at every hop (speculate_exact = "
            f"false; equal to float rounding): {summary['spec20_batch']:.2f}x at 20 ms"
        )
    print(
        f"\nwan: spec20 {summary['spec20']:.2f}x, lookup20 {summary['lookup20']:.2f}x, "
        f"ttft40 {summary['ttft40']:.2f}s, lossgap20 {summary['lossgap20']:.2f}x, "
        f"sessions8 {summary['sessions8']:.2f}x"
    )
    return summary


@contextmanager
def cleaned_up() -> Iterator[None]:
    """SIGTERM leaves through the callers' finally blocks, as Ctrl-C does."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2 prompts a set, 24 tokens a generation, 4 TTFT pairs; each "
        "speculating ring on the set the closing line compares it on",
    )
    ap.add_argument("--tokens", type=int, default=64, help="tokens a generation")
    ap.add_argument("--prompts", type=int, default=6, help="prompts of each set per row")
    ap.add_argument(
        "--pairs", type=int, default=None, help="TTFT pairs at 0 and 40 ms (12; 4 with --quick)"
    )
    ap.add_argument(
        "--rate-mbit", type=float, default=0.0, help="pace every link to this rate (0 = unpaced)"
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=(*MODES, BATCHED),
        help="rings to run ('off' always runs: the bounds are drawn from it)",
    )
    ap.add_argument(
        "--kernel-tcp",
        action="store_true",
        help="keep the kernel's TCP slow start after idle (default: off, as kvasird's "
        "service install sets it)",
    )
    ap.add_argument(
        "--moe",
        action="store_true",
        help="the MoE ring instead (two stages, two expert workers; stages without experts "
        "and with a fallback replica) at 0 / 5 / 20 ms",
    )
    ap.add_argument(
        "--settle-s",
        type=float,
        default=SETTLE_S,
        help="hold each TTFT pair's link setting this long before its question",
    )
    ap.add_argument(
        "--delays",
        nargs="+",
        type=float,
        default=None,
        help="only the link conditions at these one-way delays, ms (0 always runs: the "
        "bounds are drawn from it)",
    )
    ap.add_argument(
        "--skip",
        nargs="+",
        choices=("sessions", "ttft"),
        default=[],
        help="leave out the concurrent sessions, or the TTFT pairs",
    )
    ap.add_argument(
        "--past-eos",
        action="store_true",
        help="every generation --tokens long, the edits too (ignore_eos; see ANSWER_ENDS)",
    )
    ap.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = ap.parse_args()
    args.modes = ["off", *(m for m in args.modes if m != "off")]
    if args.delays is not None:
        args.delays = {0.0, *args.delays}
    if args.quick:
        args.tokens, args.prompts = min(args.tokens, 24), min(args.prompts, 2)
        args.pairs = 4 if args.pairs is None else args.pairs
    args.pairs = 12 if args.pairs is None else args.pairs
    if os.geteuid() != 0:
        print(
            "bench_wan needs root (network namespaces): sudo .venv/bin/python bench/bench_wan.py",
            file=sys.stderr,
        )
        return 2
    model = bundled_path()
    began = time.monotonic()
    root = Path(tempfile.gettempdir()) / f"{PREFIX}{os.getpid()}"
    with cleaned_up():
        stale = remove_stale()
        if stale:
            print(f"removed what a killed run left: {' '.join(stale)}", flush=True)
        wan = Wan.create(4 if args.moe else len(PLACEMENT), args.kernel_tcp)
        args.cc_used = wan.cc
        rows: list[Row] = []
        crowd = ttft = None
        try:
            emulator = wan.itself()
            if args.moe:
                moe = run_moe(wan, root, args)
                print(f"\nemulator: {EMULATOR}\n{emulator.text()}")
                summary = report_moe(moe)
                if args.json:
                    args.json.write_text(json.dumps(
                        {"emulator": EMULATOR, "itself": asdict(emulator),
                         "moe": [asdict(m) for m in moe], "wan_moe": summary}, indent=1) + "\n")
                print(f"({time.monotonic() - began:.0f} s)")
                return 0
            for mode in args.modes:
                print(f"ring with speculate = {mode} ...", flush=True)
                ring = Ring.start(wan, root, mode, model)
                print(f"  the gateway's speculation: {ring.speculation()}", flush=True)
                try:
                    rows += run_ring(wan, ring, args, lossy=False)
                    if mode == "off" and "ttft" not in args.skip:
                        # before the lossy rows: the lanes' windows after a loss (SETTLE_S)
                        ttft = paired_ttft(wan, ring, args.pairs, settle_s=args.settle_s)
                    if mode == "off" and "sessions" not in args.skip:
                        crowd = sessions(wan, ring, args)
                        print(
                            f"  {crowd.many} sessions: {crowd.many_tok_s:.1f} tok/s, one: "
                            f"{crowd.one_tok_s:.1f}; batches {crowd.batches}",
                            flush=True,
                        )
                    if ttft is not None:  # a fresh ring: the pairs' switches linger (SETTLE_S)
                        ring.stop()
                        print("  (a fresh ring for the lossy rows)", flush=True)
                        ring = Ring.start(wan, root, mode, model, name=f"{mode}-lossy")
                    rows += run_ring(wan, ring, args, lossy=True)
                    print(f"  after its rows: {ring.speculation()}", flush=True)
                finally:
                    ring.stop()
            frames = wan.links(0.0, 0.0)
        finally:
            wan.destroy()
            shutil.rmtree(root, ignore_errors=True)
        summary = report(rows, crowd, ttft, emulator, frames, args)
    print(f"({time.monotonic() - began:.0f} s)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "emulator": EMULATOR,
                    "itself": asdict(emulator),
                    "frames": frames,
                    "tokens": args.tokens,
                    "past_eos": args.past_eos,
                    "prompts": args.prompts,
                    "rows": [asdict(r) for r in rows],
                    "sessions": asdict(crowd) if crowd else None,
                    "ttft_pairs": asdict(ttft) if ttft else None,
                    "wan": summary,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        serve_client()
    else:
        try:
            sys.exit(main())
        except (Stopped, KeyboardInterrupt):
            print(
                "bench_wan: stopped; every namespace and process it made is removed",
                file=sys.stderr,
            )
            sys.exit(1)
