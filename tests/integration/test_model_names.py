"""A model its owner named (`kvasird model add FILE --name NAME`) is that name where users
see it: the gateway's /v1/models and its status, and requests may name it so; the content
id stays underneath and is accepted too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvasird.localnet import LocalNet
from kvasird.model.manifest import Manifest
from kvasird.model.testmodels import make_model

pytestmark = pytest.mark.slow

NAME = "qwen3.6:35b-a3b"


@pytest.mark.parametrize("local", [True, False], ids=["whole model in the gateway", "ring"])
def test_the_name_given_at_model_add_is_what_the_gateway_serves(tmp_path: Path,
                                                                 local: bool) -> None:
    path = make_model(tmp_path / "model.gguf", arch="qwen3", n_layer=2, dtype="q8_0")
    model_id = Manifest.from_gguf(path).model_id
    net = LocalNet(tmp_path / "net", 1, settings={
        "market.model": str(path), "market.memory_budget_mb": 100, "market.target_replicas": 1,
        "market.heartbeat_s": 1.0, "market.enroll_delay_s": 0.0, "compute.threads": 1,
        "gateway.local": local})
    with net:
        node = net.nodes[0]
        net.configure(node, [])
        subprocess.run([sys.executable, "-m", "kvasird", "--home", str(node.home.root), "model",
                        "add", str(path), "--name", NAME], check=True, capture_output=True,
                       timeout=120)
        node.spawn()
        node.wait_ready()
        net.wait_until("the gateway answers", lambda: httpx.get(
            node.status()["gateway"] + "/health", timeout=5).status_code == 200, 120)
        url = node.status()["gateway"]
        listed = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["name"]) for m in listed] == [(model_id, NAME)]
        for asked in (NAME, model_id):
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": asked, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
