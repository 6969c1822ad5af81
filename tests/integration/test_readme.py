"""Every command in the README, run as the README says (placeholders filled in)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from readme import ROOT, commands, kvasird_args

from kvasird.config import render
from kvasird.home import Home
from kvasird.localnet import LocalNet
from tests.support import eventually

pytestmark = pytest.mark.slow

KVASIRD = [sys.executable, "-m", "kvasird"]


def test_the_readme_shows_the_two_commands_first_and_ci_runs_the_second() -> None:
    lines = commands()
    assert lines[0] == "native/setup && .venv/bin/kvasird localnet up"
    assert lines[1] == "native/setup && native/check"
    assert lines[1] in (ROOT / ".ci" / "run").read_text()


def test_every_kvasird_command_in_the_readme_exists() -> None:
    """Each command's --help, the commands' processes side by side (one per command)."""
    lines: dict[tuple[str, ...], str] = {}  # command -> the first README line that uses it
    for line in commands():
        args = kvasird_args(line)
        if args is not None:
            lines.setdefault(tuple([a for a in args if not a.startswith("-")][:1]), line)
    helps = {sub: subprocess.Popen([*KVASIRD, *sub, "--help"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True) for sub in lines}
    try:
        for sub, proc in helps.items():
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"README command {lines[sub]!r}: {err}"
    finally:
        for proc in helps.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_hobbyist_commands_work_against_a_running_node(
        tmp_path: Path, localnet: Callable[..., LocalNet]) -> None:
    net = localnet(1, settings={"gateway.enabled": False})
    net.up()
    join = net.nodes[0].join_addr
    home = tmp_path / "hobbyist"
    env = {**os.environ, "KVASIRD_HOME": str(home)}
    ran = 0
    for line in commands(walked=False):  # the walked ones: test_hand_built_network.py
        args = kvasird_args(line)
        if args is None or args[0] in ("localnet", "service") or args[0] == "run":
            continue  # localnet: the next test; service: needs root + systemd; run: below
        args = [join if a.startswith("/ip4/") else a for a in args]
        if args[0] == "init":
            args = [a for a in args if a != "--network" and a != "kvasir-local"]
            args += ["--network", "localnet"]
            subprocess.run([*KVASIRD, *args], env=env, check=True, capture_output=True, timeout=60)
            # Keep the test on loopback: no mDNS multicast, no listening on every interface.
            config = home / "kvasird.toml"
            config.write_text(render(config.read_text(), {
                "p2p.mdns": False, "p2p.listen": ["/ip4/127.0.0.1/tcp/0"],
                "admin.listen": "127.0.0.1:0", "gateway.listen": "127.0.0.1:0"}))
            node = subprocess.Popen([*KVASIRD, "run"], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            # the admin address is written once every service listens
            eventually("kvasird run is ready", Home(home).admin_address, timeout=60,
                       alive=lambda n=node: n.poll() is None)
            ran += 1
            continue
        done = subprocess.run([*KVASIRD, *args], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 or args[0] == "wallet", f"{line!r}: {done.stderr}"
        ran += 1
    node.send_signal(signal.SIGTERM)
    assert node.wait(15) == 0
    assert ran >= 8


def test_the_main_command_answers_a_paid_prompt_and_cleans_up(tmp_path: Path) -> None:
    line = commands()[0].split("&&", 1)[1].strip()  # setup has run: the test command did it
    args = kvasird_args(line)
    assert args is not None
    # Ctrl-C as a terminal sends it, whatever this test process's own SIGINT disposition
    # (an ignored signal is inherited across exec, and Python then never raises on it)
    proc = subprocess.Popen([*KVASIRD, *args, "--dir", str(tmp_path / "ln")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            out = proc.stdout.readline()
            if not out:
                break
            seen.append(out)
            if out.startswith("running; press Ctrl-C"):
                break
        text = "".join(seen)
        assert "model smollm2:135m-instruct (" in text, text  # the name every node lists
        assert "A: " in text and "Paris" in text.split("A: ", 1)[1], text
        assert "paid" in text and "KVR on the local chain" in text
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # three daemons drain (up to 10 s each before a kill) and the chain stops
            rest, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
            raise AssertionError("kvasird localnet up did not stop within 120 s of Ctrl-C; "
                                 f"it printed:\n{''.join(seen)}{rest}") from None
    assert "stopped 3 daemons" in rest
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "ln")], capture_output=True,
                               text=True).stdout.split()
    assert leftovers == []
