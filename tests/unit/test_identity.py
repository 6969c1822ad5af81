from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvasird.errors import HomeError
from kvasird.identity import create_node_key, load_node_key


def test_node_key_is_private_and_reloads_to_the_same_peer_id(tmp_path: Path) -> None:
    key = create_node_key(tmp_path / "node.key")
    assert stat.S_IMODE((tmp_path / "node.key").stat().st_mode) == 0o600
    assert load_node_key(tmp_path / "node.key").peer_id == key.peer_id
    assert key.peer_id.to_string().startswith("12D3KooW")  # Ed25519 identity


def test_existing_key_is_never_replaced(tmp_path: Path) -> None:
    create_node_key(tmp_path / "node.key")
    before = (tmp_path / "node.key").read_bytes()
    with pytest.raises(HomeError, match="refusing to replace"):
        create_node_key(tmp_path / "node.key")
    assert (tmp_path / "node.key").read_bytes() == before


def test_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    create_node_key(tmp_path / "node.key")
    os.chmod(tmp_path / "node.key", 0o644)
    with pytest.raises(HomeError, match="chmod 600"):
        load_node_key(tmp_path / "node.key")


def test_truncated_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    create_node_key(path)
    path.write_bytes(path.read_bytes()[:5])
    with pytest.raises(HomeError, match="not a kvasird node key"):
        load_node_key(path)
