"""A local network of hosts made of Linux network namespaces, for tests that build a
kvasird network by hand the way users do on several machines.

    netns <tag>sw     the switch: a bridge br0, nothing else
      |  veth per host (created in the host's namespace, moved into the switch's)
    netns <tag>h0     host 0   eth0 10.77.6.1/24   its own loopback, its own ports
    netns <tag>h1     host 1   eth0 10.77.6.2/24
    ...

Each host is a machine of its own: every daemon on it uses the default ports (4001 for
peers, 8080 for its gateway, 5101 for its admin API), its loopback is private, and the
others reach it only at its 10.77.6.x address. Nothing is added to, routed through or
read from the host's own network; only 10.77.0.0/16 test addresses are used.

``Lan.create(n)`` raises ``NetnsUnavailable`` (the reason to skip) where namespaces cannot
be made; ``destroy()`` kills every process started through ``Host.spawn`` and removes the
namespaces (their veths and the bridge go with them).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netns import NetnsUnavailable, _run

SUBNET = "10.77.6"


@dataclass
class Host:
    """One machine of the LAN: a namespace with one address."""

    ns: str
    """The namespace's name."""
    ip: str
    """Its address on the LAN."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """Processes started here (killed by Lan.destroy)."""

    def argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, *argv: str, env: dict[str, str] | None = None, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command on this host and wait for it."""
        done = subprocess.run(self.argv(*argv), capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})
        if check and done.returncode != 0:
            raise AssertionError(f"`{' '.join(argv)}` on {self.ns} exited {done.returncode}:\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def spawn(self, *argv: str, log: Path, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        """Start a long-running command on this host, its output appended to ``log``."""
        with log.open("ab") as out:
            proc = subprocess.Popen(self.argv(*argv), stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})},
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def python(self, code: str, *args: str, timeout: float = 120) -> Any:
        """Run Python code on this host; it prints one JSON value, which is returned."""
        done = self.run(sys.executable, "-c", code, *args, timeout=timeout)
        return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass
class Lan:
    hosts: list[Host]
    tag: str
    made: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, n: int) -> Lan:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if not shutil.which("ip"):
            raise NetnsUnavailable("iproute2 (`ip`) is not installed")
        tag = "kv" + secrets.token_hex(3)
        lan = cls([Host(f"{tag}h{i}", f"{SUBNET}.{i + 1}") for i in range(n)], tag)
        try:
            lan._wire()
        except BaseException:
            lan.destroy()
            raise
        return lan

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    def _wire(self) -> None:
        for ns in (self.switch, *(h.ns for h in self.hosts)):
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            port = f"p{i}"
            # Made inside the host's namespace, its peer moved straight into the switch's:
            # neither end ever exists on this machine's own network.
            _run("ip", "-n", host.ns, "link", "add", "eth0", "type", "veth", "peer", "name",
                 port, "netns", self.switch)
            _run("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")

    def destroy(self) -> None:
        for host in self.hosts:
            for proc in host.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
        for ns in reversed(self.made):
            # A namespace's leftover processes would keep its network alive.
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True, timeout=30).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()
