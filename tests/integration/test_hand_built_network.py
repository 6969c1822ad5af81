"""A network built by hand, the way README's hobbyist section builds it, on four "machines".

Four network namespaces on one LAN (lan.py) are four hosts, each with its own loopback and
the default ports; nothing is pre-wired. Host A runs the local chain, reachable by its RPC
URL only, and adds the bundled model; B and C join by A's join line and serve the model
by its name; D joins holding nothing, as a gateway only. Every step is a `kvasird`
command run on its host, as the README says, or an HTTP request to that host's gateway.

    A  10.77.6.1   localchain + node (adds the model)
    B  10.77.6.2   node, serves the model by its name
    C  10.77.6.3   node, serves the model by its name
    D  10.77.6.4   node, holds nothing: a gateway only, and a consumer who pays
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import handbuilt
import pytest
import readme
from lan import Host, Lan
from netns import NetnsUnavailable

pytestmark = pytest.mark.slow

KVASIRD = str(Path(os.environ.get("VIRTUAL_ENV", ".venv")).resolve() / "bin" / "kvasird")
MODEL = "smollm2:135m-instruct"
PROMPT = "Name three colours of the rainbow."
"""The README's own question."""
README_A = "192.168.1.10"
"""Machine A's address in the README's example."""
START_S = 240.0
"""Four Python daemons starting at once on two busy cores, the first downloading nothing
but splitting a model among the others: a generous bound for "serves"."""


@pytest.fixture
def lan() -> Iterator[Lan]:
    try:
        made = Lan.create(4)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield made
    finally:
        made.destroy()


class Machine:
    """One host with one kvasird home on it, driven by `kvasird` commands as a user would."""

    def __init__(self, host: Host, home: Path, log: Path) -> None:
        self.host, self.home, self.log = host, home, log
        self.proc: Any = None

    def kvasird(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        return self.command(*args, check=check, timeout=timeout).stdout

    def command(self, *args: str, check: bool = True, timeout: float = 120
                ) -> subprocess.CompletedProcess[str]:
        """``kvasird --home HOME ARGS`` typed on this host."""
        return self.host.run(KVASIRD, "--home", str(self.home), *args, check=check,
                             timeout=timeout)

    def start(self) -> None:
        self.proc = self.host.spawn(KVASIRD, "--home", str(self.home), "run", log=self.log)

    def join_line(self) -> str:
        return next(line for line in self.kvasird("id").splitlines()
                    if line.startswith(f"/ip4/{self.host.ip}/tcp/"))

    def http(self, method: str, path: str, body: Any = None, timeout: float = 120) -> Any:
        """A request to this host's own gateway, from this host: (status, JSON body)."""
        code = ("import httpx, json, sys\n"
                "r = httpx.request(sys.argv[1], 'http://127.0.0.1:8080' + sys.argv[2],\n"
                "                  json=json.loads(sys.argv[3]), timeout=300)\n"
                "print(json.dumps([r.status_code, r.json()]))")
        return self.host.python(code, method, path, json.dumps(body), timeout=timeout)

    def chat(self, prompt: str = PROMPT, n: int = 1) -> list[str]:
        """``n`` greedy chat completions in a row through this host's gateway."""
        code = ("import httpx, json, sys\n"
                "out = []\n"
                "with httpx.Client(base_url='http://127.0.0.1:8080', timeout=300) as c:\n"
                "    for _ in range(int(sys.argv[2])):\n"
                "        r = c.post('/v1/chat/completions', json={'model': sys.argv[3],\n"
                "            'messages': [{'role': 'user', 'content': sys.argv[1]}],\n"
                "            'max_tokens': 16, 'temperature': 0})\n"
                "        assert r.status_code == 200, r.text\n"
                "        out.append(r.json()['choices'][0]['message']['content'])\n"
                "print(json.dumps(out))")
        return self.host.python(code, prompt, str(n), MODEL, timeout=60 + 30 * n)

    def health(self) -> tuple[int, Any]:
        code = ("import httpx, json\n"
                "try:\n"
                "    r = httpx.get('http://127.0.0.1:8080/health', timeout=10)\n"
                "    print(json.dumps([r.status_code, r.json()]))\n"
                "except httpx.HTTPError as exc:\n"
                "    print(json.dumps([0, str(exc)]))")
        return tuple(self.host.python(code))  # type: ignore[return-value]

    def tail(self) -> str:
        """The end of its log, without the access log's lines."""
        if not self.log.exists():
            return ""
        lines = [x for x in self.log.read_text().splitlines() if '"event": "request"' not in x]
        return "\n".join(lines[-30:])

    def json(self, *args: str) -> Any:
        return json.loads(self.kvasird(*args))

    def wallet(self) -> dict[str, Any]:
        return self.json("wallet", "--json")


def wait_until(what: str, predicate: Callable[[], Any], timeout: float,
               machines: list[Machine]) -> None:
    handbuilt.wait_until(what, predicate, timeout, lambda: "\n".join(
        f"--- {m.host.ns} ---\n{m.tail()}" for m in machines))


def test_a_network_built_by_hand_serves_pays_and_survives_goodbyes(
        lan: Lan, tmp_path: Path) -> None:
    a, b, c, d = (Machine(h, tmp_path / name / "home", tmp_path / f"{name}.log")
                  for h, name in zip(lan.hosts, "abcd"))
    everyone = [a, b, c, d]
    machines = {"A": [a], "B and C": [b, c], "D": [d]}
    consumer = str(tmp_path / "consumer.json")

    network, paying, claiming = readme.blocks(walked=True)

    def typed(line: readme.Line) -> list[str]:
        """The README line's arguments, with its example addresses this LAN's."""
        args = readme.kvasird_args(line.text)
        assert args is not None, line
        return [a.join_line() if x.startswith(f"/ip4/{README_A}/") else
                x.replace(README_A, a.host.ip).replace("me.json", consumer)
                for x in args if x != "&"]

    # The network, host by host, as README's hobbyist section builds it.
    for line in network:
        for m in machines[line.section.split(":")[0]]:
            args = typed(line)
            if line.text.endswith("&"):
                m.host.spawn(KVASIRD, "--home", str(m.home), *args, log=tmp_path / "chain.log")
            elif args == ["run"]:
                m.start()
                wait_until(f"{m.host.ns} runs", lambda m=m: m.command(
                    "status", check=False).returncode == 0, START_S, everyone)
            elif args[:2] == ["wallet", "faucet"] and m is a:  # the chain may still start
                wait_until("the local chain's faucet", lambda m=m, args=args: m.command(
                    *args, check=False).returncode == 0, 60, everyone)
            else:
                m.command(*args)
    for m in everyone:
        wait_until(f"{m.host.ns} serves", lambda m=m: m.health()[0] == 200, START_S, everyone)

    # Every gateway: the same model id, the same greedy text.
    ids = {m.host.ns: [x["id"] for x in m.http("GET", "/v1/models")[1]["data"]]
           for m in everyone}
    assert set(map(tuple, ids.values())) == {(MODEL,)}, ids
    texts = {m.host.ns: m.chat()[0] for m in everyone}
    assert len(set(texts.values())) == 1 and texts[a.host.ns], texts

    # A consumer on D, with a wallet of their own, pays D's gateway with one command
    # (greedy here, to compare the answer).
    *funding, pay = [typed(line) for line in paying]
    for args in funding:
        d.command(*args)
    before = d.json("wallet", "--keypair", consumer, "--json")["kvr"]
    paid = d.command(*pay, "--temperature", "0", "--max-tokens", "16")
    assert paid.stdout.strip() == texts[a.host.ns].strip(), paid
    assert "KVR" in paid.stderr, paid.stderr
    assert d.json("wallet", "--keypair", consumer, "--json")["kvr"] < before

    # Fifty requests in a row through B.
    assert len(b.chat(n=50)) == 50

    # Every serving node earns, and a claim pays out on chain.
    for m in (a, b, c):
        wait_until(f"{m.host.ns} has earnings", lambda m=m: m.wallet()["pending"] > 0, 120,
                   everyone)
    before = b.wallet()["kvr"]
    for line in claiming:
        b.command(*typed(line))
    wait_until("B's claim lands on chain", lambda: b.wallet()["kvr"] > before, 120, everyone)
    earned, status = b.wallet(), b.json("status", "--json")
    assert status["model"]["name"] == MODEL and status["health"]["status"] == "ok", status
    assert status["earnings"]["received"] > 0, status
    assert d.json("status", "--json")["role"]["units"] == []

    # SIGTERM of C: A stops listing C within 5 s, and requests keep working.
    c_peer = c.kvasird("id").splitlines()[0]
    c.proc.send_signal(signal.SIGTERM)
    said = time.monotonic()
    wait_until("A stops listing C", lambda: c_peer not in a.kvasird("coverage", "--json"), 30,
               everyone)
    assert time.monotonic() - said < 5.0
    assert c.proc.wait(timeout=60) == 0
    assert d.chat()[0] == texts[a.host.ns]

    # kill -9 and restart of B: serving again within 30 s, its earnings intact.
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(timeout=30)
    b.start()
    restarted = time.monotonic()
    wait_until("B serves again", lambda: b.health()[0] == 200, 120, everyone)
    assert time.monotonic() - restarted < 30.0
    assert b.chat()[0] == texts[a.host.ns]
    again, books = b.wallet(), b.json("status", "--json")["earnings"]
    assert again["kvr"] >= earned["kvr"] and again["pending"] >= earned["pending"], (earned, again)
    assert books["received"] >= status["earnings"]["received"], (status, books)
