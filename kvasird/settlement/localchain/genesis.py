"""The local chain's genesis: the authority (mint authority, faucet, genesis wallet) and KVR mint.

Both keypairs live in ``<data>/genesis.json`` (0600), so a restarted local chain has the
same mint and the same genesis wallet, and local tools can sign governance messages.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from solders.keypair import Keypair

from kvasird.settlement.errors import ChainError


@dataclass(frozen=True)
class Genesis:
    """The keys a local chain is born with."""

    authority: Keypair
    """KVR mint authority, faucet payer, and the network's genesis wallet."""
    mint: Keypair
    """The KVR mint account's keypair (only its address matters after genesis)."""


def load_or_create_genesis(path: Path) -> tuple[Genesis, bool]:
    """The genesis in ``path``, creating it if absent; the flag says whether it is new."""
    try:
        data = json.loads(path.read_text())
        return Genesis(
            Keypair.from_bytes(bytes(data["authority"])), Keypair.from_bytes(bytes(data["mint"]))
        ), False
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError):
        raise ChainError(
            f"{path} is damaged: delete the local chain's data directory "
            f"({path.parent}) to start a new local chain"
        ) from None
    genesis = Genesis(Keypair(), Keypair())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(
            {"authority": list(bytes(genesis.authority)), "mint": list(bytes(genesis.mint))}, f
        )
    return genesis, True
