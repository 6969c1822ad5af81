"""``kvasird generate``: the prompt, the model's tokenizer, and a real daemon answering."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvasird.cli import main
from kvasird.config import render
from kvasird.localnet import LocalNet
from kvasird.model.manifest import Manifest
from kvasird.text.tokenizer import Tokenizer
from kvasird_dev.cli import main as dev_main


@pytest.fixture(scope="module")
def home_serving_by_id(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A home whose [market] model is a model id, with only that model's manifest and shards
    in its store (the GGUF it came from is gone, as on a node that joined by id). The tests
    only read it, so the module shares one."""
    root = tmp_path_factory.mktemp("by-id")
    home, gguf = root / "home", root / "tiny.gguf"
    assert dev_main(["make-model", str(gguf), "--layers", "1"]) == 0
    assert main(["--home", str(home), "init"]) == 0
    assert main(["--home", str(home), "model", "add", str(gguf), "--name", "tiny"]) == 0
    listed = io.StringIO()
    with contextlib.redirect_stdout(listed):
        assert main(["--home", str(home), "model", "list", "--json"]) == 0
    [model] = json.loads(listed.getvalue())
    config = home / "kvasird.toml"
    config.write_text(render(config.read_text(), {"market.model": model["model_id"]}))
    expected = Tokenizer.from_gguf(gguf).encode("Hello there")
    gguf.unlink()
    return home, json.dumps(expected)


@pytest.mark.parametrize("named", [[], ["--model", "tiny"]])
def test_a_model_named_by_id_or_label_is_tokenized_from_its_manifest(
        home_serving_by_id: tuple[Path, str], named: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """With no daemon running, getting as far as the daemon shows the prompt was tokenized."""
    home, _ = home_serving_by_id
    assert main(["--home", str(home), "generate", "Hello there", *named]) == 1
    err = capsys.readouterr().err
    assert "no daemon is running" in err and "tokenizer" not in err


def test_the_manifest_tokenizer_is_the_gguf_tokenizer(home_serving_by_id: tuple[Path, str]) -> None:
    from kvasird.home import Home
    from kvasird.model.store import ShardStore

    home, expected = home_serving_by_id
    with ShardStore.open(Home(home)) as store:
        manifest = store.manifest(store.resolve("tiny"))
    tokens = Tokenizer.from_metadata(manifest.metadata, "tiny").encode("Hello there")
    assert json.dumps(tokens) == expected


@pytest.mark.parametrize("prompt", ["", "   "])
def test_an_empty_prompt_is_refused_as_empty(prompt: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--home", str(tmp_path), "init"]) == 0
    capsys.readouterr()
    assert main(["--home", str(tmp_path), "generate", prompt]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "the prompt is empty" in line and "shorten" not in line


@pytest.mark.slow
def test_generate_works_on_a_node_that_names_its_model_by_id(tmp_path: Path) -> None:
    """The join path: [market] model is an id; the GGUF itself is not on this machine."""
    gguf = tmp_path / "tiny.gguf"
    assert dev_main(["make-model", str(gguf), "--layers", "1"]) == 0
    model_id = Manifest.from_gguf(gguf).model_id
    with LocalNet(tmp_path / "net", 1, settings={
            "market.model": model_id, "market.memory_budget_mb": 200,
            # it enrolls at once, not after the default 10 s a joining node waits
            "market.enroll_delay_s": 0.0, "market.heartbeat_s": 1.0}) as net:
        node = net.nodes[0]
        net.configure(node, [])
        assert main(["--home", str(node.home.root), "model", "add", str(gguf)]) == 0
        gguf.unlink()
        node.start()
        net.wait_until("its gateway can route the model (/health 200)", lambda: httpx.get(
            node.status()["gateway"] + "/health", timeout=5).status_code == 200, timeout=90)
        done = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(node.home.root),
                               "generate", "Hello", "--max-tokens", "3"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1 prompt + 3 generated tokens" in done.stderr and done.stdout.strip()
