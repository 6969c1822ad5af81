"""Governance gossip relays only what this node can vouch for: forgeries stop at the first hop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from solders.keypair import Keypair

from kvasird.settlement.gossip import GovernanceGossip
from kvasird.wire.protocols import GOVERNANCE_TOPIC
from kvasird.errors import ConfigError
from kvasird.settlement.governance import Governance, GovernanceMessage, sign_governance
from kvasird.settlement.pricing import PriceController
from kvasird.settlement.service import Settlement
from kvasird.wire import pack

from .conftest import NETWORK
from .test_governance import params

FORWARDER = ID(b"forwarder")


@dataclass
class GovernedSettlement:
    """The part of Settlement the governance gossip uses, with Settlement's own apply."""

    governance: Governance
    prices: PriceController
    apply_governance = Settlement.apply_governance


CONFIG_PATH = "/var/lib/kvasird/kvasird.toml"


def gossip_of(governance: Governance | None, genesis_wallet: str = "") -> GovernanceGossip:
    """The gossip of a node whose settlement is ``governance`` (None: settlement off); it
    validates without publishing, so it needs no gossip router."""
    settled = GovernedSettlement(governance, PriceController()) if governance else None
    return GovernanceGossip(None, lambda: settled,  # type: ignore[arg-type,return-value]
                            NETWORK, genesis_wallet, CONFIG_PATH)


async def relays(gossip: GovernanceGossip, message: GovernanceMessage | dict[str, Any]) -> bool:
    wire = message.to_wire() if isinstance(message, GovernanceMessage) else message
    return await gossip._validate(FORWARDER, rpc_pb2.Message(data=pack(wire),
                                                             topicIDs=[GOVERNANCE_TOPIC]))


async def test_forged_message_that_is_not_newer_is_not_relayed(governance: Governance) -> None:
    assert not await relays(gossip_of(governance), sign_governance(Keypair(), NETWORK, params(0)))


async def test_genuine_message_for_another_network_is_not_relayed(
    governance: Governance, genesis: Keypair
) -> None:
    other_network = sign_governance(genesis, "kvasir-other", params(0))
    assert not await relays(gossip_of(governance), other_network)


async def test_newer_genuine_message_is_applied_and_relayed_and_so_is_its_republication(
    governance: Governance, genesis: Keypair
) -> None:
    gossip = gossip_of(governance)
    message = sign_governance(genesis, NETWORK, params(1))
    assert await relays(gossip, message)
    assert governance.params() == params(1) and gossip.latest == message.to_wire()
    assert await relays(gossip, message)


async def test_older_genuine_message_is_not_relayed(
    governance: Governance, genesis: Keypair
) -> None:
    gossip = gossip_of(governance)
    old = sign_governance(genesis, NETWORK, params(1))
    for message in (old, sign_governance(genesis, NETWORK, params(2))):
        assert await relays(gossip, message)
    assert not await relays(gossip, old)
    assert governance.params() == params(2)


async def test_node_without_settlement_relays_only_messages_the_configured_genesis_signed(
    genesis: Keypair,
) -> None:
    gossip = gossip_of(None, str(genesis.pubkey()))
    assert await relays(gossip, sign_governance(genesis, NETWORK, params(1)))
    assert not await relays(gossip, sign_governance(Keypair(), NETWORK, params(1)))
    assert not await relays(gossip, sign_governance(genesis, "kvasir-other", params(1)))


async def test_node_without_settlement_or_genesis_relays_only_well_formed_messages() -> None:
    gossip = gossip_of(None)
    assert await relays(gossip, sign_governance(Keypair(), NETWORK, params(1)))
    assert not await relays(gossip, {"network": NETWORK, "params": {}, "signature": "x"})


def test_malformed_genesis_wallet_in_the_config_says_which_key_to_fix() -> None:
    with pytest.raises(ConfigError, match=r"\[settlement\] genesis_wallet in /var/lib/kvasird"):
        gossip_of(None, "not-an-address")
