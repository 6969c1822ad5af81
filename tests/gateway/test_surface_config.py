"""The [gateway] keys of the surface: max_n, parse_special, cors_origins."""

from __future__ import annotations

import re

import pytest

from kvasird.config import default_text, load_text
from kvasird.errors import ConfigError


def test_the_defaults_allow_eight_choices_parse_special_tokens_and_no_cors() -> None:
    gw = load_text(default_text()).gateway
    assert (gw.max_n, gw.parse_special, gw.cors_origins) == (8, True, ())


@pytest.mark.parametrize(("text", "fragment"), [
    ("max_n = 0", "gateway.max_n = 0 is out of range"),
    ("max_n = 2.5", "gateway.max_n must be an integer"),
    ('parse_special = "no"', "gateway.parse_special must be true or false"),
    ('cors_origins = "http://localhost:5173"', "gateway.cors_origins must be a list of strings"),
    ('cors_origins = ["localhost:5173"]', "gateway.cors_origins has 'localhost:5173', which is "
                                          "not an origin: write scheme://host"),
    ('cors_origins = ["http://localhost:5173/app"]', "not an origin"),
    ('cors_origins = ["https://ui.example.com"]',
     "refuses pages of 'ui.example.com': add 'ui.example.com' to gateway.allowed_hosts"),
])
def test_a_bad_value_names_its_key_and_what_to_write(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_text(f"[gateway]\n{text}\n")


@pytest.mark.parametrize("settings", [
    'cors_origins = ["*"]',
    'cors_origins = ["http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8000"]',
    'cors_origins = ["https://ui.example.com"]\nallowed_hosts = ["ui.example.com"]',
    'cors_origins = ["http://203.0.113.5:3000"]\nlisten = "203.0.113.5:8080"',
])
def test_origins_the_host_guard_admits_are_accepted(settings: str) -> None:
    assert load_text(f"[gateway]\n{settings}\n").gateway.cors_origins
