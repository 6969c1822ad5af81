"""Creating and loading the node key."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from kvasird.errors import HomeError

_SEED_BYTES = 32


@dataclass(frozen=True)
class NodeKey:
    keypair: KeyPair
    """The libp2p Ed25519 key pair."""

    @property
    def peer_id(self) -> ID:
        return ID.from_pubkey(self.keypair.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.keypair.private_key.sign(data)


def create_node_key(path: Path) -> NodeKey:
    """Write a fresh key to ``path`` (0600); refuse to replace an existing one."""
    seed = os.urandom(_SEED_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise HomeError(
            f"{path} already exists: refusing to replace a node key "
            "(it is this node's identity); use another --home for a new node"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(seed)
    return _from_seed(seed)


def load_node_key(path: Path) -> NodeKey:
    try:
        mode = path.stat().st_mode
        seed = path.read_bytes()
    except FileNotFoundError:
        raise HomeError(f"{path} is missing: run `kvasird init`") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise HomeError(
            f"{path} is readable by others (mode {oct(mode & 0o777)}): run `chmod 600 {path}`"
        )
    if len(seed) != _SEED_BYTES:
        raise HomeError(
            f"{path} is not a kvasird node key ({len(seed)} bytes, expected "
            f"{_SEED_BYTES}): restore it from a backup or init a new home"
        )
    return _from_seed(seed)


def _from_seed(seed: bytes) -> NodeKey:
    private = Ed25519PrivateKey.from_bytes(seed)
    return NodeKey(KeyPair(private, private.get_public_key()))
