"""Governance over gossip: network parameters signed by the genesis wallet reach every node.

A message is applied only by the settlement subsystem's checks (signature of the genesis
wallet, this network, a version above the current one). Nodes re-publish the latest
message they hold now and then, so a node that joins later learns the parameters in force.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2

from kvasird.errors import WireError
from kvasird.logs import get_logger
from kvasird.settlement.errors import GovernanceRejected
from kvasird.settlement.governance import GovernanceMessage
from kvasird.wire import pack, schema, unpack

if TYPE_CHECKING:
    from kvasird.daemon.node import Node

log = get_logger("kvasird.governance")

TOPIC = "governance"
MAX_MESSAGE_BYTES = 4096
REPUBLISH_S = 60.0


class GovernanceGossip:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.latest: dict[str, Any] | None = None
        """The newest message applied here, as it travels on the wire."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        gossip = self.node.p2p.gossip
        gossip.set_validator(TOPIC, self._validate)
        sub = await gossip.subscribe(TOPIC)
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, sub)
            while True:
                await trio.sleep(REPUBLISH_S)
                if self.latest is not None:
                    await gossip.publish(TOPIC, pack(self.latest))

    async def publish(self, message: GovernanceMessage) -> None:
        """Apply locally, then gossip (used by the genesis operator's tooling and tests)."""
        await self.node.p2p.gossip.publish(TOPIC, pack(message.to_wire()))

    async def _validate(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        try:
            if len(msg.data) > MAX_MESSAGE_BYTES:
                raise WireError(f"governance message of {len(msg.data)} bytes")
            wire = schema.mapping(unpack(msg.data, MAX_MESSAGE_BYTES), "governance")
            message = GovernanceMessage.from_wire(wire)
        except (WireError, GovernanceRejected) as exc:
            log.info("governance message refused", reason=str(exc)[:200])
            return False
        settlement = self.node.settlement
        if settlement is None:
            return True  # nothing to apply here; well-formed, so pass it on
        if message.params.version <= settlement.governance.params().version:
            return True  # already in force (a re-publication) or older: nothing to do
        try:
            params = settlement.apply_governance(wire)
        except GovernanceRejected as exc:
            log.warning("governance message refused", reason=str(exc)[:200])
            return False
        self.latest = wire
        log.info("network parameters changed", version=params.version, floor=params.floor,
                 ceiling=params.ceiling)
        return True


async def _drain(sub: Any) -> None:
    while True:
        await sub.get()
