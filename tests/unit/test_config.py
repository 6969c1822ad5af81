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
    ('[p2p]\nlisten = ["/ip4/0.0.0.0/tcp/99999"]\n', "p2p.listen: '/ip4/0.0.0.0/tcp/99999' is not"),
    ('[p2p]\nannounce = ["/ip4/1.2.3.4/tcp/65536"]\n', "p2p.announce: '/ip4/1.2.3.4/tcp/65536'"),
    ('[admin]\nlisten = "127.0.0.1:99999"\n', "admin.listen = '127.0.0.1:99999' must be"),
    ('[gateway]\nlisten = "127.0.0.1"\n', "gateway.listen = '127.0.0.1' must match"),
    ('[gateway]\nlisten = "127.0.0.1:123456"\n', "gateway.listen = '127.0.0.1:123456'"),
    ("[inference]\nlane_port = 70000\n", "inference.lane_port = 70000 is out of range"),
    ("[inference]\nlane_port = -1\n", "inference.lane_port = -1 is out of range"),
])
def test_bad_values_name_file_key_and_what_is_allowed(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_text(text, source="/etc/x/kvasird.toml")
    assert "/etc/x/kvasird.toml" in str(err.value)
    assert fragment in str(err.value)


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "[::1]:65536", "localhost:70000"])
def test_gateway_port_past_65535_is_refused_naming_the_key(listen: str) -> None:
    with pytest.raises(ConfigError, match=r"gateway\.listen = .* out of range: allowed 0\.\.65535"):
        load_text(f'[gateway]\nlisten = "{listen}"\n')


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.1:65535", "[::1]:8080", "localhost:1"])
def test_gateway_ports_in_range_are_accepted(listen: str) -> None:
    assert load_text(f'[gateway]\nlisten = "{listen}"\n').gateway.listen == listen


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
