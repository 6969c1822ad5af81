"""The [gateway] section of kvasird.toml."""

from __future__ import annotations

import pytest

from kvasird.config import default_text, load_text
from kvasird.errors import ConfigError


def test_the_gateway_listens_on_loopback_8080_by_default() -> None:
    gw = load_text(default_text()).gateway
    assert (gw.enabled, gw.listen, gw.local) == (True, "127.0.0.1:8080", False)
    assert gw.max_body_bytes == 1 << 20 and gw.max_concurrent == 16


def test_every_gateway_key_is_commented_in_the_default_file() -> None:
    section = default_text().split("[gateway]", 1)[1].split("\n[", 1)[0]
    lines = section.splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"{line!r} has no comment above it"


@pytest.mark.parametrize(("text", "fragment"), [
    ('[gateway]\nlisten = "8080"\n', "gateway.listen"),
    ("[gateway]\nmax_concurrent = 0\n", "gateway.max_concurrent = 0 is out of range"),
    ('[gateway]\nlocal = "yes"\n', "gateway.local must be true or false"),
])
def test_bad_gateway_values_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_text(text)


def test_port_zero_is_allowed() -> None:
    assert load_text('[gateway]\nlisten = "127.0.0.1:0"\n').gateway.listen == "127.0.0.1:0"
