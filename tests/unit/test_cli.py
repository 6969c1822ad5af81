"""The CLI's offline commands, run in-process through ``main`` as a user would type them."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvasird import home as home_module
from kvasird.cli import main
from kvasird.config import load

PEER = "12D3KooWESNwYUkewwdrtKoRqtf8HD43B1fEcnjCzBuQyw2qh5av"
ADDR = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"


def kvasird(home: Path, *args: str) -> int:
    return main(["--home", str(home), *args])


def test_init_creates_home_key_config_and_db(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    assert kvasird(home, "init", "--network", "demo", "--bootstrap", ADDR) == 0
    assert stat.S_IMODE((home / "node.key").stat().st_mode) == 0o600
    assert (home / "state.db").exists()
    config = load(home / "kvasird.toml")
    assert config.node.network == "demo"
    assert config.p2p.bootstrap == (ADDR,)
    assert "12D3KooW" in capsys.readouterr().out


def test_init_refuses_to_overwrite_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvasird(tmp_path, "init") == 0
    key = (tmp_path / "node.key").read_bytes()
    assert kvasird(tmp_path, "init") == 1
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (tmp_path / "node.key").read_bytes() == key


def test_init_with_a_bad_bootstrap_address_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvasird(tmp_path / "h", "init", "--bootstrap", "/ip4/127.0.0.1/tcp/4001") == 1
    assert "/p2p/<peer id>" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()


def test_id_prints_the_peer_id_without_a_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kvasird(tmp_path, "init")
    capsys.readouterr()
    assert kvasird(tmp_path, "id") == 0
    assert capsys.readouterr().out.strip().startswith("12D3KooW")


def test_bootstrap_add_list_rm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kvasird(tmp_path, "init")
    assert kvasird(tmp_path, "bootstrap", "add", ADDR) == 0
    assert kvasird(tmp_path, "bootstrap", "add", ADDR) == 0  # idempotent
    capsys.readouterr()
    kvasird(tmp_path, "bootstrap", "list")
    assert capsys.readouterr().out.split() == [ADDR]
    assert kvasird(tmp_path, "bootstrap", "rm", PEER) == 0
    assert load(tmp_path / "kvasird.toml").p2p.bootstrap == ()
    assert kvasird(tmp_path, "bootstrap", "rm", PEER) == 1


def test_bootstrap_add_rejects_an_address_without_peer_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kvasird(tmp_path, "init")
    assert kvasird(tmp_path, "bootstrap", "add", "/ip4/127.0.0.1/tcp/4001") == 1
    assert "lacks /p2p/" in capsys.readouterr().err
    assert load(tmp_path / "kvasird.toml").p2p.bootstrap == ()


def test_status_without_a_daemon_says_how_to_start_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kvasird(tmp_path, "init")
    assert kvasird(tmp_path, "status") == 1
    assert "kvasird --home" in capsys.readouterr().err


def test_commands_on_an_uninitialised_home_say_to_init(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvasird(tmp_path / "nothing", "run") == 1
    assert "init" in capsys.readouterr().err


def test_native_info_reports_the_cpu_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["native", "info", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"CPU"' in out and '"threads"' in out


def test_home_is_accepted_after_the_subcommand_too(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    assert main(["init", "--home", str(home), "--network", "demo"]) == 0
    assert load(home / "kvasird.toml").node.network == "demo"
    assert main(["bootstrap", "add", ADDR, "--home", str(home)]) == 0
    assert main(["wallet", "--home", str(home), "new"]) == 0
    assert (home / "wallet.json").exists()
    capsys.readouterr()
    elsewhere = str(tmp_path / "elsewhere")
    assert main(["--home", elsewhere, "bootstrap", "list", "--home", str(home)]) == 0
    assert capsys.readouterr().out.split() == [ADDR]


@pytest.mark.parametrize("command", [
    ["status"], ["peers"], ["id"], ["coverage"], ["run"], ["model", "list"],
    ["model", "inspect", "tiny"], ["model", "drop", "tiny"], ["bootstrap", "list"],
    ["wallet"], ["wallet", "new"], ["wallet", "link"], ["generate", "hello"], ["chat", "hi"],
])
def test_a_command_on_a_missing_home_says_how_to_make_one_and_creates_nothing(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    typo = tmp_path / "typo"
    assert main(["--home", str(typo), *command]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert f"no kvasird home at {typo}" in line and f"kvasird init --home {typo}" in line
    assert not typo.exists()


def test_the_command_list_matches_what_each_command_registers() -> None:
    import argparse
    import importlib

    from kvasird.cli import COMMANDS

    for name, text in COMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"kvasird.cli.{name}").register(sub)
        [shown] = [a.help for a in sub._choices_actions if a.dest == name]
        assert shown == text, name


def test_a_second_node_on_one_machine_takes_one_port_base_and_its_model_and_budget(
        tmp_path: Path) -> None:
    assert kvasird(tmp_path / "b", "init", "--listen", "127.0.0.1", "--port-base", "4101",
                   "--model", "bundled:smollm2", "--budget", "2GiB", "--bootstrap", ADDR) == 0
    config = load(tmp_path / "b" / "kvasird.toml")
    assert config.p2p.listen == ("/ip4/127.0.0.1/tcp/4101", "/ip4/127.0.0.1/tcp/4104/ws")
    assert (config.gateway.listen, config.admin.listen) == ("127.0.0.1:4102", "127.0.0.1:4103")
    assert (config.market.model, config.market.memory_budget_mb) == ("bundled:smollm2", 2048)
    assert config.p2p.bootstrap == (ADDR,)
    assert kvasird(tmp_path / "c", "init", "--listen", "/ip4/0.0.0.0/tcp/5001",
                   "--budget", "512M") == 0
    config = load(tmp_path / "c" / "kvasird.toml")
    assert (config.p2p.listen, config.market.memory_budget_mb) == (("/ip4/0.0.0.0/tcp/5001",), 512)


def test_init_refuses_a_budget_or_model_it_cannot_read_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvasird(tmp_path / "h", "init", "--budget", "lots") == 1
    assert "write it like 512M, 2GiB or 1.5G" in capsys.readouterr().err
    assert kvasird(tmp_path / "h", "init", "--model", str(tmp_path / "none.gguf")) == 1
    assert "there is no file at" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()


def test_the_example_in_a_bad_bootstrap_address_error_is_accepted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvasird(tmp_path / "h", "init", "--bootstrap", "/ip4/203.0.113.7/tcp/4001/p2p/X") == 1
    example = re.search(r"example: (\S+)", capsys.readouterr().err)
    assert example is not None
    assert kvasird(tmp_path / "h", "init", "--bootstrap", example[1]) == 0


def test_a_reader_that_stops_early_ends_a_command_without_a_traceback(tmp_path: Path) -> None:
    """`kvasird wallet | head -3` ended in a BrokenPipeError traceback."""
    assert kvasird(tmp_path, "init") == 0
    reader, writer = os.pipe()
    os.close(reader)  # `head` that has read what it wanted
    try:
        done = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(tmp_path), "id"],
                              stdout=writer, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(writer)
    assert (done.returncode, done.stderr) == (141, "")


def test_commands_find_the_service_home_when_the_user_has_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`sudo kvasird status` on a machine running the service works on the service's home
    (its location is the one thing replaced: this test may not write /var/lib)."""
    service = tmp_path / "var-lib-kvasird"
    assert kvasird(service, "init", "--bootstrap", ADDR) == 0
    monkeypatch.setattr(home_module, "SERVICE_HOME", service)
    monkeypatch.delenv("KVASIRD_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "root"))
    capsys.readouterr()
    assert main(["bootstrap", "list"]) == 0
    assert capsys.readouterr().out.split() == [ADDR]
    assert main(["status"]) == 1
    assert f"no daemon is running for {service}" in capsys.readouterr().err
    assert main(["init"]) == 0  # init makes the user's own home, never the service's
    assert (tmp_path / "root" / ".kvasird" / "node.key").exists()
