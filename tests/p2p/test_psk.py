"""The private-network key: file formats, and who can connect to whom."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import trio
from libp2p.peer.peerinfo import PeerInfo

from kvasird.errors import ConfigError
from kvasird.p2p.psk import fingerprint, load_psk

KEY = secrets.token_hex(32)
OTHER = secrets.token_hex(32)

pytestmark = pytest.mark.slow  # real sockets; failed handshakes wait out their timeouts


def test_go_libp2p_swarm_key_and_bare_hex_both_load(tmp_path: Path) -> None:
    (tmp_path / "swarm.key").write_text(f"/key/swarm/psk/1.0.0/\n/base16/\n{KEY.upper()}\n")
    (tmp_path / "bare.key").write_text(KEY + "\n")
    assert load_psk(str(tmp_path / "swarm.key")) == load_psk(str(tmp_path / "bare.key")) == KEY
    assert load_psk("") is None
    assert len(fingerprint(KEY)) == 12 and fingerprint(None) == ""


def test_short_or_missing_key_file_says_what_to_fix(tmp_path: Path) -> None:
    (tmp_path / "short.key").write_text("abcd\n")
    with pytest.raises(ConfigError, match="64 hex digits"):
        load_psk(str(tmp_path / "short.key"))
    with pytest.raises(ConfigError, match="cannot be read"):
        load_psk(str(tmp_path / "missing.key"))


async def _connects(hosts, psks: list[str | None]) -> bool:  # noqa: ANN001 - fixture factory
    async with hosts(psks) as (a, b):
        with trio.move_on_after(4):  # a wrong key hangs the handshake rather than failing it
            try:
                await a.connect(PeerInfo(b.get_id(), b.get_addrs()))
                await a.new_stream(b.get_id(), ["/ipfs/id/1.0.0"])
                return True
            except Exception:  # noqa: BLE001 - any failure is "cannot connect"
                return False
    return False


async def test_nodes_with_the_same_key_connect(hosts) -> None:  # noqa: ANN001
    assert await _connects(hosts, [KEY, KEY])


async def test_node_without_the_key_cannot_connect_either_way(hosts) -> None:  # noqa: ANN001
    connected: dict[str, bool] = {}

    async def attempt(way: str, psks: list[str | None]) -> None:
        connected[way] = await _connects(hosts, psks)

    async with trio.open_nursery() as nursery:  # both ways at once: each waits out its bound
        nursery.start_soon(attempt, "keyless to keyed", [None, KEY])
        nursery.start_soon(attempt, "keyed to keyless", [KEY, None])
    assert connected == {"keyless to keyed": False, "keyed to keyless": False}


async def test_node_with_another_key_cannot_connect(hosts) -> None:  # noqa: ANN001
    assert not await _connects(hosts, [OTHER, KEY])
