"""The operator's wallet: a Solana keypair file, or only a public address to be paid at.

The keypair file is Solana's JSON format (a list of 64 byte values: secret seed then
public key), mode 0600, so ``solana-keygen`` and kvasird read each other's files.
A wallet links itself to this node's peer id with a statement it signs; peers check
that statement before paying to the address it names.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

from kvasird.settlement.errors import WalletError

_LINK_DOMAIN = b"kvasir-wallet-link-v1\n"


def parse_address(text: str) -> Pubkey:
    try:
        return Pubkey.from_string(text.strip())
    except ValueError:
        raise WalletError(f"{text!r} is not a Solana address (base58, 32 bytes)") from None


def write_keypair(path: Path, keypair: Keypair) -> None:
    """Write ``keypair`` to ``path`` (0600); refuse to replace an existing wallet."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise WalletError(
            f"{path} already exists: refusing to replace a wallet "
            "(it may hold funds); choose another path"
        ) from None
    with os.fdopen(fd, "w") as f:
        json.dump(list(bytes(keypair)), f)


def read_keypair(path: Path) -> Keypair:
    try:
        mode = path.stat().st_mode
        values = json.loads(path.read_text())
    except FileNotFoundError:
        raise WalletError(
            f"{path} is missing: create it with `kvasird wallet new` "
            "or point [settlement] wallet at your Solana keypair file"
        ) from None
    except ValueError:
        raise WalletError(
            f"{path} is not JSON: a Solana keypair file is a list of 64 numbers"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise WalletError(
            f"{path} is readable by others (mode {oct(mode & 0o777)}): run `chmod 600 {path}`"
        )
    if not (
        isinstance(values, list) and len(values) == 64 and all(isinstance(v, int) for v in values)
    ):
        raise WalletError(f"{path} is not a Solana keypair file (expected a list of 64 numbers)")
    try:
        return Keypair.from_bytes(bytes(values))
    except ValueError:
        raise WalletError(f"{path}: the public half does not match the secret half") from None


@dataclass(frozen=True)
class Wallet:
    """The operator's wallet; ``keypair`` is None when only the address is known."""

    address: Pubkey
    """Where this node is paid."""
    keypair: Keypair | None = None
    """Signing key; needed to run a gateway vault, pay out, or sign a link statement."""

    @classmethod
    def from_keypair(cls, keypair: Keypair) -> Wallet:
        return cls(keypair.pubkey(), keypair)

    @classmethod
    def load(cls, path: Path | None, address: str = "") -> Wallet:
        if path is not None:
            return cls.from_keypair(read_keypair(path))
        if address:
            return cls(parse_address(address))
        raise WalletError(
            "no wallet configured: set [settlement] wallet (a keypair file) "
            "or wallet_address (receive only)"
        )

    def signer(self) -> Keypair:
        if self.keypair is None:
            raise WalletError(
                f"only the address {self.address} is known: this needs the keypair; "
                "set [settlement] wallet to its keypair file"
            )
        return self.keypair


@dataclass(frozen=True)
class WalletLink:
    """A wallet's signed statement that a peer id is paid at it."""

    peer_id: str
    """The libp2p peer id string of the node."""
    network: str
    """Network name, so a link cannot be replayed on another network."""
    wallet: Pubkey
    """The payout address."""
    signature: Signature
    """The wallet's signature over ``message()``."""

    def message(self) -> bytes:
        return link_message(self.peer_id, self.network, self.wallet)

    def verify(self) -> bool:
        return self.signature.verify(self.wallet, self.message())

    def to_wire(self) -> dict[str, str]:
        return {
            "peer_id": self.peer_id,
            "network": self.network,
            "wallet": str(self.wallet),
            "signature": str(self.signature),
        }

    @classmethod
    def from_wire(cls, data: dict[str, str]) -> WalletLink:
        """Parse and verify; a link that does not verify never leaves this function."""
        try:
            link = cls(
                str(data["peer_id"]),
                str(data["network"]),
                Pubkey.from_string(data["wallet"]),
                Signature.from_string(data["signature"]),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise WalletError(f"malformed wallet link: {exc}") from None
        if not link.verify():
            raise WalletError(f"wallet link for {link.peer_id} is not signed by {link.wallet}")
        return link


def link_message(peer_id: str, network: str, wallet: Pubkey) -> bytes:
    """The canonical bytes a wallet signs to link itself to a peer id."""
    return _LINK_DOMAIN + f"network={network}\npeer={peer_id}\nwallet={wallet}\n".encode()


def sign_link(keypair: Keypair, peer_id: str, network: str) -> WalletLink:
    message = link_message(peer_id, network, keypair.pubkey())
    return WalletLink(peer_id, network, keypair.pubkey(), keypair.sign_message(message))
