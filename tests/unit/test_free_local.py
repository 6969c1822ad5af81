"""[settlement] free_local: "auto" is on only while the gateway listens on loopback, and the
daemon says at start which settings are risky together."""

from __future__ import annotations

import pytest

from kvasird.config import default_text, load_text, render
from kvasird.daemon.banner import print_banner
from kvasird.daemon.risks import risky_settings
from kvasird.errors import ConfigError

PAID = "[settlement]\nenabled = true\nwallet = \"wallet.json\"\n"


def config_text(listen: str, free_local: str = "", extra: str = "") -> str:
    line = f"free_local = {free_local}\n" if free_local else ""
    return f'{PAID}{line}[gateway]\nlisten = "{listen}"\n{extra}'


@pytest.mark.parametrize(("listen", "free_local", "in_effect"), [
    ("127.0.0.1:8080", "", True), ("[::1]:8080", "", True), ("localhost:8080", "", True),
    ("0.0.0.0:8080", "", False), ("[::]:8080", "", False), ("192.0.2.5:8080", "", False),
    ("gpu-box.lan:8080", "", False), ("0.0.0.0:8080", '"auto"', False),
    ("127.0.0.1:8080", '"auto"', True), ("0.0.0.0:8080", "true", True),
    ("127.0.0.1:8080", "false", False)])
def test_free_local_is_on_where_set_and_by_default_only_on_a_loopback_listen(
        listen: str, free_local: str, in_effect: bool) -> None:
    assert load_text(config_text(listen, free_local)).free_local_in_effect() is in_effect


def test_the_default_file_leaves_free_local_to_the_listen_address() -> None:
    assert load_text(default_text()).settlement.free_local is None
    assert load_text(render(default_text(), {"settlement.enabled": True})).free_local_in_effect()


def test_without_payments_nothing_is_free_for_this_machine_alone() -> None:
    assert not load_text('[settlement]\nfree_local = true\n').free_local_in_effect()


@pytest.mark.parametrize("value", ['"yes"', "1", '""', '"true"'])
def test_a_bad_free_local_is_refused_naming_what_is_allowed(value: str) -> None:
    with pytest.raises(ConfigError, match=r'settlement\.free_local must be true, false or "auto"'):
        load_text(f"[settlement]\nfree_local = {value}\n")


def test_free_local_set_on_for_a_public_listen_is_a_risk_naming_the_key() -> None:
    [risk] = risky_settings(load_text(config_text("203.0.113.5:8080", "true")), "/etc/k.toml")
    assert risk.startswith("[settlement] free_local = true while [gateway] listen = "
                           "'203.0.113.5:8080' reaches beyond this machine")
    assert "X-Forwarded-For" in risk and "421" not in risk
    assert risk.endswith("set free_local = false in /etc/k.toml")


def test_on_every_address_the_risk_also_says_other_names_get_421() -> None:
    [risk] = risky_settings(load_text(config_text("0.0.0.0:8080", "true")), "k.toml")
    assert "anything but a loopback address get 421" in risk
    named = config_text("0.0.0.0:8080", "true", 'allowed_hosts = ["gw.example"]\n')
    [risk] = risky_settings(load_text(named), "k.toml")
    assert "421" not in risk


def test_a_public_paid_gateway_without_a_keypair_is_a_risk() -> None:
    text = '[settlement]\nenabled = true\nwallet_address = "x"\n[gateway]\nlisten = "[::]:80"\n'
    [risk] = risky_settings(load_text(text), "k.toml")
    assert "[settlement] wallet names no keypair file" in risk
    assert "neither refund a request that fails nor pay the peers" in risk


@pytest.mark.parametrize("text", [
    config_text("127.0.0.1:8080", "true"), config_text("0.0.0.0:8080"),
    config_text("0.0.0.0:8080", "false"),
    config_text("0.0.0.0:8080", "true", "enabled = false\n"),
    '[settlement]\nfree_local = true\n[gateway]\nlisten = "0.0.0.0:8080"\n'])
def test_safe_combinations_are_no_risk(text: str) -> None:
    assert risky_settings(load_text(text), "k.toml") == []


def test_the_banner_ends_with_each_risk_on_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    """"ready" comes later, once the node serves (kvasird.daemon.node)."""
    status = {"version": "0", "peer_id": "p", "network": "n", "listen_addrs": [],
              "join_addr": "", "gateway": ""}
    print_banner(status, "http://127.0.0.1:5101", "k.toml", ["one risk", "another"])
    assert capsys.readouterr().out.endswith("warning      one risk\nwarning      another\n")
