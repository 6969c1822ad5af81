from __future__ import annotations

from pathlib import Path

import pytest

from kvasird.config import default_text, load, load_text, render
from kvasird.errors import ConfigError


def test_default_file_loads_and_matches_dataclass_defaults() -> None:
    config = load_text(default_text())
    assert config.node.network == "kvasir-local"
    assert config.p2p.liveness_timeout_s == 15.0
    assert config.admin.listen.startswith("127.0.0.1:")


def test_missing_keys_take_the_defaults() -> None:
    config = load_text('[node]\nnetwork = "mynet"\n')
    assert config.node.network == "mynet"
    assert config.p2p.heartbeat_interval_s == 5.0


@pytest.mark.parametrize(("text", "fragment"), [
    ("[p2p]\nliveness_timeout_s = 500\n", "p2p.liveness_timeout_s = 500 is out of range"),
    ('[p2p]\nmax_peers = "many"\n', "p2p.max_peers must be an integer"),
    ('[node]\nlog_level = "loud"\n', "use one of 'debug'"),
    ('[node]\nnetwork = "Has Spaces"\n', "node.network"),
    ("[nodes]\nx = 1\n", "unknown section [nodes]"),
    ("[p2p]\nlisten_addr = []\n", "unknown key p2p.listen_addr"),
    ('[admin]\nlisten = "0.0.0.0:5101"\n', "must be a loopback host:port"),
    ('[p2p]\nbootstrap = ["/ip4/127.0.0.1/tcp/4001"]\n', "lacks /p2p/<peer id>"),
    ('[p2p]\nlisten = ["tcp://127.0.0.1:4001"]\n', "is not a multiaddr"),
    ("[p2p\n", "is not valid TOML"),
])
def test_bad_values_name_file_key_and_what_is_allowed(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_text(text, source="/etc/x/kvasird.toml")
    assert "/etc/x/kvasird.toml" in str(err.value)
    assert fragment in str(err.value)


def test_missing_file_says_to_run_init(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kvasird init"):
        load(tmp_path / "kvasird.toml")


def test_render_keeps_comments_and_sets_values() -> None:
    text = render(default_text(), {"p2p.bootstrap": ["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWESNwYUkewwdrtKoRqtf8HD43B1fEcnjCzBuQyw2qh5av"],
                                   "node.network": "demo"})
    assert "# Name of the network to join" in text
    config = load_text(text)
    assert config.node.network == "demo"
    assert len(config.p2p.bootstrap) == 1


def test_render_adds_keys_and_sections_the_file_lacks() -> None:
    text = render('[node]\nnetwork = "x"\n', {"node.log_level": "debug", "p2p.max_peers": 7})
    config = load_text(text)
    assert config.node.log_level == "debug"
    assert config.p2p.max_peers == 7
