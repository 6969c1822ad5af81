"""One daemon per home: a second `kvasird run` on a held home exits at once, naming the holder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvasird.daemon.init import init_home
from kvasird.errors import HomeError
from kvasird.home import Home

LOOPBACK_ONLY = {"p2p.listen": ["/ip4/127.0.0.1/tcp/0"], "p2p.mdns": False,
                 "admin.listen": "127.0.0.1:0", "gateway.enabled": False}
"""Should the lock ever fail to stop it, the second daemon stays on this machine."""


@pytest.fixture
def home(tmp_path: Path) -> Home:
    home = Home(tmp_path / "home")
    init_home(home, LOOPBACK_ONLY)
    return home


def held_message(home: Home) -> str:
    return (f"another kvasird (pid {os.getpid()}) is running on {home.root}: stop it first "
            f"(`kvasird --home {home.root} status`)")


def test_a_held_home_refuses_a_second_holder(home: Home) -> None:
    with home.exclusive(), pytest.raises(HomeError) as refused, home.exclusive():
        pass
    assert str(refused.value) == held_message(home)


def test_the_lock_is_free_again_once_released(home: Home) -> None:
    with home.exclusive():
        pass
    with home.exclusive():
        pass


@pytest.mark.slow
def test_second_run_on_a_held_home_exits_with_the_holders_pid(home: Home) -> None:
    with home.exclusive():
        second = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(home.root), "run"],
                                capture_output=True, text=True, timeout=30)
    assert second.returncode == 1
    assert held_message(home) in second.stderr
