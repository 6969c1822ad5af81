"""[compute] device: the ggml device a node computes on. This build has the CPU alone:
naming it computes what the default does; a device it lacks is refused where it is named
(the daemon's start, `kvasird verify --device`) with the devices it has and what to do."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvasird.compute.errors import ComputeError
from kvasird.compute.graph import Backend, use_device
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage
from kvasird.daemon.init import init_home
from kvasird.home import Home

LOOPBACK_ONLY = {"p2p.listen": ["/ip4/127.0.0.1/tcp/0"], "p2p.mdns": False,
                 "admin.listen": "127.0.0.1:0", "gateway.enabled": False}
MISSING = "NODEVICE0"


@pytest.fixture
def default_device() -> Iterator[None]:
    yield
    use_device("")


def test_the_cpu_by_name_computes_what_the_default_does(models: dict[str, Path],
                                                         default_device: None) -> None:
    ids = np.array([3, 14, 15, 92, 65])
    out = []
    for name in ("", "CPU"):
        use_device(name)
        stage = Stage.load(models["moe_q4k"], threads=1, kv=KVSpec(n_slots=256))
        try:
            assert stage.backend.cpu and stage.backend.name == "CPU"
            assert stage.weights.packed is not None  # the CPU's kernels read Q4_K repacked
            with stage.open_session() as s:
                out.append(stage.forward(s, ids, logits="all"))
        finally:
            stage.close()
    assert np.array_equal(out[0], out[1])


def test_a_device_this_build_lacks_is_refused_with_the_ones_it_has(default_device: None) -> None:
    for refuse in (lambda: Backend(1, MISSING), lambda: use_device(MISSING)):
        with pytest.raises(ComputeError) as refused:
            refuse()
        assert f"no ggml device named {MISSING!r}" in str(refused.value)
        assert "has CPU" in str(refused.value) and "kvasird native info" in str(refused.value)


def test_verify_on_a_missing_device_says_so_and_fails() -> None:
    done = subprocess.run([sys.executable, "-m", "kvasird", "verify", "--device", MISSING,
                           "--prompts", "1", "--greedy-tokens", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"no ggml device named {MISSING!r}" in done.stderr, done.stderr


def test_a_daemon_configured_for_a_missing_device_stops_at_once_saying_why(
        tmp_path: Path) -> None:
    home = Home(tmp_path / "home")
    init_home(home, {**LOOPBACK_ONLY, "compute.device": MISSING})
    done = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(home.root), "run"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"no ggml device named {MISSING!r}" in done.stderr, done.stderr
