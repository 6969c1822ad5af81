"""Gossipsub for the control plane, configured so it does not silently drop.

Topics are ``kvasir/<network>/<name>`` (coverage, models, governance, ...). py-libp2p's
defaults drop messages at normal rates (a 10 msg/s per-topic spam limit per forwarding
peer) and keep every message forever for equivocation detection (STACK.md): the limit is
raised to what a network of heartbeating nodes produces, and the map is cleared on a timer.
Messages are signed (strict signing) by the libp2p key; topic validators are the place
where records are checked before anyone uses them (the market subsystem installs them).

What one peer sends can end only that peer's stream, never the daemon: py-libp2p's read
loop lets some errors out (a malformed RPC raises protobuf's DecodeError) into the pubsub
service, whose failure would end the gossip nursery and the node with it; so its read
loop and the tasks it starts per message are contained (``_ContainedPubsub``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.score import ScoreParams, TopicScoreParams
from libp2p.tools.anyio_service import background_trio_service

from kvasird.logs import get_logger

GOSSIPSUB = "/meshsub/1.1.0"
MAX_MESSAGES_PER_TOPIC_PER_S = 500.0
EQUIVOCATION_SWEEP_S = 60.0
PUBLISH_TIMEOUT_S = 2.0
log = get_logger("kvasird.p2p.gossip")

# Scoring is on (py-libp2p leaves it off): every record a topic validator refuses costs
# the forwarder 10 points, decaying by 1% a heartbeat; below -100 a peer is graylisted
# (its RPCs are ignored), below -50 we stop publishing to it, below -20 gossiping to it.
SCORE_PARAMS = ScoreParams(
    p4_invalid_messages=TopicScoreParams(weight=10.0, cap=1000.0, decay=0.99),
    publish_threshold=-50.0, gossip_threshold=-20.0, graylist_threshold=-100.0,
    accept_px_threshold=0.0,
)

Validator = Callable[[ID, rpc_pb2.Message], Awaitable[bool]]


class Gossip:
    def __init__(self, host: IHost, network: str, heartbeat_s: float = 1.0) -> None:
        self.network = network
        self.router = GossipSub(
            [GOSSIPSUB], degree=6, degree_low=4, degree_high=12,
            heartbeat_interval=max(1, int(heartbeat_s)),
            spam_protection_enabled=True,
            max_messages_per_topic_per_second=MAX_MESSAGES_PER_TOPIC_PER_S,
            score_params=SCORE_PARAMS,
        )
        self.pubsub = _ContainedPubsub(host, self.router, strict_signing=True)
        # A message's id is (signer, seqno), and py-libp2p counts seqnos up from the start
        # time in seconds. A node publishing more than once a second runs ahead of the
        # clock, so after a restart its new messages reuse ids its peers saw from the old
        # process: dropped as duplicates (seen for 120 s) or as equivocation, its records
        # unheard for half a minute or more. Counting from the start in microseconds
        # keeps a restarted node's seqnos past its old ones.
        self.pubsub.counter = time.time_ns() // 1000

    def topic(self, name: str) -> str:
        return f"kvasir/{self.network}/{name}"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.pubsub), background_trio_service(self.router):
            await self.pubsub.wait_until_ready()
            task_status.started()
            while True:
                await trio.sleep(EQUIVOCATION_SWEEP_S)
                self.router.equivocation_detection.clear()

    def ban(self, peer: str) -> None:
        """Drop every message ``peer`` signs or forwards, until ``unban``: a liar. Dropped
        before any validator, so the honest peers that forward its records before they
        caught it themselves are not scored down for them."""
        self.pubsub.add_to_blacklist(ID.from_base58(peer))

    def unban(self, peer: str) -> None:
        self.pubsub.remove_from_blacklist(ID.from_base58(peer))

    def set_validator(self, name: str, validator: Validator) -> None:
        self.pubsub.set_topic_validator(self.topic(name), validator, True)

    async def subscribe(self, name: str):  # noqa: ANN201 - libp2p's subscription type
        return await self.pubsub.subscribe(self.topic(name))

    async def publish(self, name: str, data: bytes, timeout_s: float = PUBLISH_TIMEOUT_S) -> bool:
        """Publish; False when it did not finish in time.

        py-libp2p writes to each mesh peer in turn, and a write to a peer that died
        unnoticed can block; a record that misses some peers is resent next heartbeat.
        """
        with trio.move_on_after(timeout_s):
            await self.pubsub.publish(self.topic(name), data)
            return True
        return False


class _ContainedPubsub(Pubsub):
    """Pubsub whose per-peer work cannot fail the service: a peer whose stream or message
    raises is logged, its stream reset and the peer dropped from the mesh (and scored down
    by its invalid messages, as usual)."""

    async def continuously_read_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            await super().continuously_read_stream(stream)
        except Exception as exc:  # noqa: BLE001 - anything a peer's bytes can raise
            log.info("gossip stream from a peer failed: dropped it", peer=str(peer),
                     error=repr(exc)[:200])
            with contextlib.suppress(Exception):
                await stream.reset()
            self._handle_dead_peer(peer)

    async def _teardown_if_connected(self, peer_id: ID) -> None:
        """A banned peer's stream closed and the peer forgotten, as py-libp2p does, but
        safe against the peer going away meanwhile: its read loop drops it while the reset
        is awaited, and py-libp2p's ``del self.peers[peer_id]`` then raised a KeyError that
        ended the pubsub service and the daemon with it (seen under load when a liar was
        banned)."""
        stream = self.peers.get(peer_id)
        if stream is not None:
            with contextlib.suppress(Exception):
                await stream.reset()
            self.peers.pop(peer_id, None)
        self._forget_all_subscriptions(peer_id)

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        try:
            await super().push_msg(msg_forwarder, msg)
        except Exception as exc:  # noqa: BLE001 - one message, from one peer
            if msg_forwarder == self.my_id:
                raise  # our own publish: its caller hears of it
            log.info("gossip message from a peer failed: dropped it", peer=str(msg_forwarder),
                     error=repr(exc)[:200])
