"""A churn soak: clients generate through one gateway while its peers die, restart and stall.

Four daemons of a pinned placement with two replicas of every layer — node 0 is the
gateway and holds the head; node 2 holds every layer, nodes 1 and 3 half each — so any
one of nodes 1-3 may be down and a route still exists:

    node 0  head                 (the gateway the clients use; never disturbed)
    node 1  layers [0, h)
    node 2  layers [0, n)
    node 3  layers [h, n)

Meanwhile ``clients`` threads each run greedy generations back to back through node 0's
admin API and never retry (every retry is the gateway's own); every ``kill_every_s`` one
of nodes 1-3 in turn is SIGKILLed and started again at once, and for ``degrade_s`` one
node is slowed by SIGSTOP/SIGCONT at a 50 % duty cycle. Each completed output is compared
with the tokens of one undisturbed daemon holding the whole model.

    Soak(root, model, duration_s=300).run() -> SoakReport (completion, equality, p50/p99
    latency, the longest pause between two tokens of each request in flight at a kill)

Used by ``bench/soak.py`` (five minutes, the table in bench/REPORT.md) and by the suite's
shorter ``tests/integration/test_soak.py``.
"""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvasird.localnet.launcher import LocalNet, LocalNode
from kvasird.localnet.placement import pinned
from kvasird.market.model import MarketModel
from kvasird.model.manifest import Manifest

PROMPTS = ([1, 504, 3458, 282, 4649, 314], [28, 1834, 253, 2145, 30],
           [46, 9, 3, 812, 1147, 288, 2], [8, 77, 901, 5, 64])
READY_S = 90.0
"""How long a (re)started node may take to load and be routed to."""


@dataclass
class Outcome:
    """One client request."""
    began: float
    ended: float
    tokens: list[int]
    gaps: list[float]
    """Seconds between the request and its first token, then between tokens."""
    error: str = ""
    equal: bool = False


@dataclass
class SoakReport:
    outcomes: list[Outcome]
    kills: list[float]
    """Monotonic times of the kills."""
    degraded: tuple[float, float] | None
    log: list[str] = field(default_factory=list)

    @property
    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.error]

    def stalls(self) -> list[float]:
        """For each kill, the longest pause of each request in flight at that moment."""
        return [max(o.gaps) for k in self.kills for o in self.completed
                if o.began <= k <= o.ended and o.gaps]

    def summary(self) -> dict[str, Any]:
        done, n = self.completed, len(self.outcomes)
        lat = sorted(o.ended - o.began for o in done)
        stalls = sorted(self.stalls())
        errors: dict[str, int] = {}
        for o in self.outcomes:
            if o.error:
                errors[o.error[:120]] = errors.get(o.error[:120], 0) + 1
        return {
            "requests": n, "completed": len(done),
            "completed_pct": 100.0 * len(done) / n if n else 0.0,
            "equal": sum(o.equal for o in done), "kills": len(self.kills),
            "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
            "stall_p50_s": _pct(stalls, 50), "stall_max_s": stalls[-1] if stalls else 0.0,
            "errors": errors,
        }


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(p) - 1] if p < 100 else xs[-1]


class Soak:
    def __init__(self, root: Path, model: Path, *, duration_s: float, kill_every_s: float = 40.0,
                 clients: int = 4, degrade_at_s: float | None = 20.0, degrade_s: float = 60.0,
                 n_tokens: int = 12) -> None:
        self.root, self.model = root, model
        self.duration_s, self.kill_every_s = duration_s, kill_every_s
        self.clients, self.n_tokens = clients, n_tokens
        self.degrade = None if degrade_at_s is None else (degrade_at_s, degrade_s)
        n = MarketModel.from_manifest(Manifest.from_gguf(model)).n_layer
        h = n // 2
        self.placement = [["head"], [f"layers:0-{h}"], [f"layers:0-{n}"], [f"layers:{h}-{n}"]]

    # --- the network -------------------------------------------------------------------

    def _start(self, net: LocalNet, placement: list[list[str]]) -> None:
        previous = ""
        for node, pins in zip(net.nodes, placement, strict=True):
            node.settings = pinned(self.model, pins)
            previous = net.configure(node, [previous] if previous else [])
        for node in net.nodes:
            node.spawn()
        for node in net.nodes:
            node.wait_ready(READY_S)
        net.wait_until("the gateway routes a request", lambda: _routable(net.nodes[0]), READY_S)

    def reference(self) -> dict[int, list[int]]:
        """The greedy tokens of one undisturbed daemon holding everything."""
        with LocalNet(self.root / "one", 1) as one:
            self._start(one, [["head", *self.placement[2]]])
            return {i: _generate(one.nodes[0], p, self.n_tokens).tokens
                    for i, p in enumerate(PROMPTS)}

    # --- the run -----------------------------------------------------------------------

    def run(self) -> SoakReport:
        want = self.reference()
        report = SoakReport([], [], None)
        with LocalNet(self.root / "net", len(self.placement)) as net:
            self._start(net, self.placement)
            began = time.monotonic()
            end = began + self.duration_s
            lock = threading.Lock()

            def client(c: int) -> None:
                i = c
                while time.monotonic() < end:
                    k = i % len(PROMPTS)
                    out = _generate(net.nodes[0], PROMPTS[k], self.n_tokens)
                    out.equal = not out.error and out.tokens == want[k]
                    with lock:
                        report.outcomes.append(out)
                    i += self.clients

            threads = [threading.Thread(target=client, args=(c,), daemon=True)
                       for c in range(self.clients)]
            for t in threads:
                t.start()
            chaos = threading.Thread(target=self._chaos, args=(net, began, end, report),
                                     daemon=True)
            chaos.start()
            for t in threads:
                t.join()
            chaos.join()
        return report

    def _chaos(self, net: LocalNet, began: float, end: float, report: SoakReport) -> None:
        """Every kill_every_s the next of nodes 1-3 is killed and started again; meanwhile
        (its own thread) node 3 is slowed for the degrade window."""
        slower = threading.Thread(target=self._slow, args=(net.nodes[3], began, end, report),
                                  daemon=True)
        slower.start()
        victims = [net.nodes[i] for i in (1, 2, 3)]
        turn, next_kill = 0, began + self.kill_every_s
        while time.monotonic() < end:
            if time.monotonic() >= next_kill:
                self._restart(victims[turn % len(victims)], report)
                turn += 1
                next_kill += self.kill_every_s
            time.sleep(0.1)
        slower.join()

    def _slow(self, node: LocalNode, began: float, end: float, report: SoakReport) -> None:
        """SIGSTOP/SIGCONT at a 50 % duty cycle through the degrade window."""
        if self.degrade is None:
            return
        at, for_s = self.degrade
        start, stop = began + at, min(began + at + for_s, end)
        while time.monotonic() < start:
            time.sleep(0.1)
        report.degraded = (start, stop)
        while time.monotonic() < stop:
            node.signal(signal.SIGSTOP)
            time.sleep(0.25)
            node.signal(signal.SIGCONT)
            time.sleep(0.25)
        node.signal(signal.SIGCONT)

    def _restart(self, node: LocalNode, report: SoakReport) -> None:
        report.kills.append(time.monotonic())
        node.signal(signal.SIGCONT)
        node.signal(signal.SIGKILL)
        if node.proc is not None:
            node.proc.wait()
        node.spawn()
        try:
            node.wait_ready(READY_S)
            report.log.append(f"node {node.index} restarted in "
                              f"{time.monotonic() - report.kills[-1]:.1f} s")
        except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
            report.log.append(f"node {node.index} did not restart: {exc}")


def _routable(node: LocalNode) -> bool:
    return not _generate(node, [1], 1).error


def _generate(node: LocalNode, prompt: list[int], n: int) -> Outcome:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    began = last = time.monotonic()
    tokens: list[int] = []
    gaps: list[float] = []
    error = ""
    try:
        url = node.home.admin_address()
        if url is None:
            raise RuntimeError("no admin address")
        with httpx.stream("POST", url + "/v0/generate", json=body, timeout=120) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:200]}"
            else:
                for line in resp.iter_lines():
                    event = json.loads(line)
                    if "error" in event:
                        error = str(event["error"])[:300]
                        break
                    if "token" in event:
                        now = time.monotonic()
                        gaps.append(now - last)
                        last = now
                        tokens.append(int(event["token"]))
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    if not error and len(tokens) != n:
        error = f"{len(tokens)} of {n} tokens"
    return Outcome(began, time.monotonic(), tokens, gaps, error)
