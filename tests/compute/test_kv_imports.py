"""The page keys are free of ggml: the gateway computes them for every prompt, and its router
and the stage protocol read them, without loading the engine. Checked by what a fresh
interpreter has imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

DRIVER = """
import importlib, sys
importlib.import_module(sys.argv[1])
print(sorted({name.split(".")[0] for name in sys.modules} & {"ggml"}))
"""


@pytest.mark.parametrize("module", [
    "kvasird.compute.kv.keys",
    "kvasird.inference.client.affinity",
    "kvasird.inference.protocol.stage",
    "kvasird.inference.client.swarm",
])
def test_page_key_users_do_not_load_ggml(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", DRIVER, module], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_the_kv_pool_does_load_ggml() -> None:
    """The check above can fail: the pool, which holds ggml tensors, is seen loading it."""
    done = subprocess.run([sys.executable, "-c", DRIVER, "kvasird.compute.kv.pool"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "['ggml']"
