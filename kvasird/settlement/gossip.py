"""Governance over gossip: network parameters signed by the genesis wallet reach every node.

A message is applied only by the settlement subsystem's checks (signature of the genesis
wallet, this network, a version above the current one). Nodes re-publish the latest
message they hold now and then, so a node that joins later learns the parameters in force.

Gossipsub relays exactly what the topic validator passes, and gossip scoring (on, see
kvasird.p2p.gossip) charges the forwarder for each message it refuses; so the validator
passes only messages this node can vouch for, and a forgery stops at the first hop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2

from kvasird.errors import ConfigError, WireError
from kvasird.logs import get_logger
from kvasird.settlement.errors import GovernanceRejected, WalletError
from kvasird.settlement.governance import GovernanceMessage, verify_governance
from kvasird.settlement.wallet import parse_address
from kvasird.wire import pack, schema, unpack
from kvasird.wire.protocols import GOVERNANCE_TOPIC

if TYPE_CHECKING:
    from solders.pubkey import Pubkey

    from kvasird.p2p.gossip import Gossip
    from kvasird.settlement.service import Settlement

log = get_logger("kvasird.governance")

MAX_MESSAGE_BYTES = 4096
REPUBLISH_S = 60.0


class GovernanceGossip:
    def __init__(
        self,
        gossip: Gossip,
        settlement: Callable[[], Settlement | None],
        network: str,
        genesis_wallet: str,
        config_path: str,
    ) -> None:
        """``settlement`` is the node's, once started (None while [settlement] is off);
        ``genesis_wallet`` is [settlement] genesis_wallet of the file at ``config_path``."""
        self._gossip = gossip
        self._settlement = settlement
        self._network = network
        self.latest: dict[str, Any] | None = None
        """The newest message applied here, as it travels on the wire."""
        self._genesis = _configured_genesis(genesis_wallet, config_path)
        """[settlement] genesis_wallet, which a node without settlement checks messages
        against; None when it is left to the local chain (unknown while settlement is off)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        gossip = self._gossip
        gossip.set_validator(GOVERNANCE_TOPIC, self._validate)
        sub = await gossip.subscribe(GOVERNANCE_TOPIC)
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, sub)
            while True:
                await trio.sleep(REPUBLISH_S)
                if self.latest is not None:
                    await gossip.publish(GOVERNANCE_TOPIC, pack(self.latest))

    async def publish(self, message: GovernanceMessage) -> None:
        """Apply locally, then gossip (used by the genesis operator's tooling and tests)."""
        await self._gossip.publish(GOVERNANCE_TOPIC, pack(message.to_wire()))

    async def _validate(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        """Whether to relay ``msg``; applies it on the way when it is newer than ours."""
        try:
            if len(msg.data) > MAX_MESSAGE_BYTES:
                raise WireError(f"governance message of {len(msg.data)} bytes")
            wire = schema.mapping(unpack(msg.data, MAX_MESSAGE_BYTES), "governance")
            message = GovernanceMessage.from_wire(wire)
        except (WireError, GovernanceRejected) as exc:
            log.info("governance message refused", reason=str(exc)[:200])
            return False
        try:
            return self._judge(wire, message)
        except GovernanceRejected as exc:
            log.warning("governance message refused", reason=str(exc)[:200])
            return False

    def _judge(self, wire: dict[str, Any], message: GovernanceMessage) -> bool:
        """Relay a message only once it verifies (network and genesis signature).

        With settlement on, a message newer than the one in force is applied and relayed;
        a message that is not newer is relayed only when it is the one in force (a
        re-publication, which late joiners need). An older genuine message is not relayed:
        it changes nothing on a node that has the current one, a node that lacks the
        current one gets it from the next re-publication, and passing old messages on
        would let anyone replay the whole history into the network at no cost.

        With settlement off there is no message in force to compare with: a message that
        verifies against [settlement] genesis_wallet is relayed. When that is empty (the
        local chain's genesis, which only a node running settlement knows) this node
        cannot judge signatures, so it relays every well-formed message, as a plain
        gossip router would; the settlement nodes on the path are the ones that filter.
        """
        settlement = self._settlement()
        if settlement is None:
            if self._genesis is not None:
                verify_governance(message, self._genesis, self._network)
            return True
        governance = settlement.governance
        governance.verify(message)
        current = governance.params().version
        if message.params.version <= current:
            if message == governance.in_force():
                return True
            raise GovernanceRejected(
                f"governance version {message.params.version} is older than the current "
                f"{current}: not relayed"
            )
        params = settlement.apply_governance(wire)
        self.latest = wire
        log.info(
            "network parameters changed",
            version=params.version,
            floor=params.floor,
            ceiling=params.ceiling,
        )
        return True


def _configured_genesis(text: str, config_path: str) -> Pubkey | None:
    if not text:
        return None
    try:
        return parse_address(text)
    except WalletError as exc:
        raise ConfigError(
            f"[settlement] genesis_wallet in {config_path}: {exc}; set it "
            "to the network's genesis wallet, or leave it empty"
        ) from None


async def _drain(sub: Any) -> None:
    while True:
        await sub.get()
