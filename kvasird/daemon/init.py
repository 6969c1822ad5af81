"""A node's home made: its key, its config (checked before anything is written), its
wallet where settlement asks for one, and an empty database. ``kvasird init`` makes one;
so does localnet, for each daemon it launches.
"""

from __future__ import annotations

from typing import Any

from solders.keypair import Keypair

from kvasird.config import default_text, load_text, render
from kvasird.db import connect
from kvasird.errors import HomeError
from kvasird.home import Home
from kvasird.identity import create_node_key
from kvasird.settlement.wallet import write_keypair


def init_home(home: Home, values: dict[str, Any]) -> str:
    """Create ``home`` with a new key and a config with ``values`` set; return the peer id.

    The config is validated before anything is written, so a bad --bootstrap leaves no
    half-made home behind. An existing key is never replaced.
    """
    text = render(default_text(), values)
    load_text(text, source="the new kvasird.toml")
    if home.node_key.exists():
        raise HomeError(
            f"{home.root} is already initialised (node key {home.node_key} exists); "
            "refusing to overwrite it. Use another --home (and --port-base) for a "
            "second node."
        )
    home.root.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = create_node_key(home.node_key)
    wallet = values.get("settlement.wallet")
    if wallet and not (home.root / wallet).exists():
        write_keypair(home.root / wallet, Keypair())
    if not home.config.exists():
        home.config.write_text(text)
    connect(home.db, create=True).close()  # a home being made may start from an empty file
    return key.peer_id.to_string()
