"""Network parameters change only by a message signed by the network's genesis wallet.

A message names its network and a version; it is applied only if the signature
verifies against the genesis wallet, the network matches, and the version is above
the current one (an old message replayed later changes nothing). Applied messages
are stored, so the parameters survive restarts and can be gossiped onwards as-is.
Config files and environment variables have no path into these parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

from kvasird.settlement.errors import GovernanceRejected
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.pricing import GENESIS_PARAMS, NetworkParams

_DOMAIN = b"kvasir-governance-v1\n"


@dataclass(frozen=True)
class GovernanceMessage:
    """Signed network parameters."""

    network: str
    """Network these parameters are for."""
    params: NetworkParams
    """The new parameters (with their version)."""
    signature: Signature
    """Genesis wallet's signature over ``body()``."""

    def body(self) -> bytes:
        return governance_body(self.network, self.params)

    def to_wire(self) -> dict[str, Any]:
        return {
            "network": self.network,
            "params": self.params.to_wire(),
            "signature": str(self.signature),
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> GovernanceMessage:
        try:
            return cls(
                str(data["network"]),
                NetworkParams.from_wire(data["params"]),
                Signature.from_string(str(data["signature"])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GovernanceRejected(f"malformed governance message: {exc}") from None


def governance_body(network: str, params: NetworkParams) -> bytes:
    return (
        _DOMAIN
        + json.dumps(
            {"network": network, "params": params.to_wire()}, sort_keys=True, separators=(",", ":")
        ).encode()
    )


def sign_governance(genesis: Keypair, network: str, params: NetworkParams) -> GovernanceMessage:
    return GovernanceMessage(
        network, params, genesis.sign_message(governance_body(network, params))
    )


def verify_governance(message: GovernanceMessage, genesis_wallet: Pubkey, network: str) -> None:
    """Raise GovernanceRejected unless ``message`` is for ``network`` and signed by the genesis
    wallet. Needs no ledger, so a node without settlement can judge a message too."""
    if message.network != network:
        raise GovernanceRejected(
            f"governance message is for network {message.network!r}, this node is on {network!r}"
        )
    if not message.signature.verify(genesis_wallet, message.body()):
        raise GovernanceRejected(
            f"governance message is not signed by the genesis wallet {genesis_wallet}: ignored"
        )


class Governance:
    """The current network parameters of one network, as proven by signed messages."""

    def __init__(self, ledger: Ledger, genesis_wallet: Pubkey, network: str) -> None:
        self._ledger = ledger
        self._genesis = genesis_wallet
        self._network = network

    def params(self) -> NetworkParams:
        in_force = self.in_force()
        return GENESIS_PARAMS if in_force is None else in_force.params

    def in_force(self) -> GovernanceMessage | None:
        """The applied message with the highest version (None while the genesis parameters hold)."""
        row = self._ledger.one(
            "SELECT message FROM settlement_governance ORDER BY version DESC LIMIT 1"
        )
        return None if row is None else GovernanceMessage.from_wire(json.loads(row[0]))

    def verify(self, message: GovernanceMessage) -> None:
        """Check network and signature only: nothing is applied or stored."""
        verify_governance(message, self._genesis, self._network)

    def apply(self, message: GovernanceMessage) -> NetworkParams:
        """Verify and store ``message``; returns the parameters now in force."""
        self.verify(message)
        with self._ledger.transaction() as db:
            current = self.params().version
            if message.params.version <= current:
                raise GovernanceRejected(
                    f"governance version {message.params.version} is not newer "
                    f"than the current {current}: ignored (stale or replayed)"
                )
            db.execute(
                "INSERT INTO settlement_governance VALUES (?, ?)",
                (message.params.version, json.dumps(message.to_wire())),
            )
        return message.params
