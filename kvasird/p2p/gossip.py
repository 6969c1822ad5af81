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

py-libp2p's publish only queues a message for each peer's sending task. A node about to
close its connections waits for those queues to be written (``flush``): its last message
(the market's goodbye) would otherwise be dropped with the queues, and peers would learn
that it left only when its record's TTL ran out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.score import ScoreParams, TopicScoreParams
from libp2p.tools.anyio_service import background_trio_service

from kvasird.logs import get_logger

GOSSIPSUB = TProtocol("/meshsub/1.1.0")

# Mesh and gossip sized for the coverage market's measured traffic (bench/market.md, the
# simulation at 10,000 nodes): records of 0.3-1 KB, published on change and kept alive
# every few minutes, so a few hundred to a few thousand messages a minute network-wide
# and every node receives each of them. What a node receives is then about
#     messages x ((D - 1) x (record + envelope) + GOSSIP_PEERS x GOSSIP_WINDOW x id)
# (each mesh peer but the one it came from forwards a copy; each node announces each id
# to GOSSIP_PEERS non-mesh peers in each of GOSSIP_WINDOW heartbeats).
# - D = 4 (3..12): three redundant paths into every node are plenty for signed, idempotent
#   records that are re-sent by their keep-alive anyway; the default 6 costs 5/3 as many
#   copies. Delivery to 10,000 nodes stays within ceil(log(10,000) / log(3)) = 9 hops.
#   D_high stays 12: a node accepts grafts up to it, so in a network of a dozen nodes all
#   peers stay in the mesh (with D_high = 8, ten daemons on loopback pruned and re-grafted
#   each other every heartbeat, "GRAFT flood", and the PRUNEs' peer exchange cost more
#   than the records saved). The simulator draws each node's degree between D and it.
# - GOSSIP_WINDOW = 1, GOSSIP_PEERS = 3: an id is announced once, to 3 peers: the message
#   ids (46 bytes: signer + seqno) cost about as much as a small record otherwise
#   (py-libp2p's 3-heartbeat window to max(6, a quarter of all peers) is 18-48 ids a
#   message and node). IWANT then recovers a lost message within a heartbeat; a record
#   lost all the same is repaired by the next keep-alive.
# - Heartbeat 1 s: mesh repair and IHAVE within a second of a churn event; an idle
#   heartbeat sends nothing (no ids: no IHAVE).
# - Adaptive gossip off: py-libp2p's "v2.0 adaptive" mode raises D by up to 4 when it
#   judges the network unhealthy (as a loaded loopback network often looks); the bytes
#   would follow, unbounded by these figures.
# - Flood publishing: py-libp2p publishes to the mesh only (it has no flood-publish
#   option), which is what a control plane of small records wants.
# - The message cache keeps GOSSIP_HISTORY heartbeats for IWANT answers (a few hundred
#   records at most).
MESH_DEGREE, MESH_DEGREE_LOW, MESH_DEGREE_HIGH = 4, 3, 12
GOSSIP_WINDOW = 1
GOSSIP_HISTORY = 3
GOSSIP_PEERS = 3
MAX_MESSAGES_PER_TOPIC_PER_S = 500.0
EQUIVOCATION_SWEEP_S = 60.0
PUBLISH_TIMEOUT_S = 2.0
FLUSH_TIMEOUT_S = 2.0
FLUSH_POLL_S = 0.01
log = get_logger("kvasird.p2p.gossip")

# Scoring is on (py-libp2p leaves it off): every record a topic validator refuses costs
# the forwarder 10 points, decaying by 1% a heartbeat; below -100 a peer is graylisted
# (its RPCs are ignored), below -50 we stop publishing to it, below -20 gossiping to it.
SCORE_PARAMS = ScoreParams(
    p4_invalid_messages=TopicScoreParams(weight=10.0, cap=1000.0, decay=0.99),
    publish_threshold=-50.0,
    gossip_threshold=-20.0,
    graylist_threshold=-100.0,
    accept_px_threshold=0.0,
)

Validator = Callable[[ID, rpc_pb2.Message], Awaitable[bool]]


class Gossip:
    def __init__(self, host: IHost, network: str, heartbeat_s: float = 1.0) -> None:
        self.network = network
        self.router = _BoundedGossip(
            [GOSSIPSUB],
            degree=MESH_DEGREE,
            degree_low=MESH_DEGREE_LOW,
            degree_high=MESH_DEGREE_HIGH,
            gossip_window=GOSSIP_WINDOW,
            gossip_history=GOSSIP_HISTORY,
            heartbeat_interval=max(1, int(heartbeat_s)),
            adaptive_gossip_enabled=False,
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

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every message published so far is written to its peers' streams; False
        when that took longer than ``timeout_s`` (a peer that stopped reading)."""
        with trio.move_on_after(timeout_s):
            while self.pubsub.unsent():  # noqa: ASYNC110 - py-libp2p's queues signal no drain
                await trio.sleep(FLUSH_POLL_S)
            return True
        return False


class _BoundedGossip(GossipSub):
    """GossipSub that announces each heartbeat's message ids to GOSSIP_PEERS peers, not to
    max(6, a quarter of all peers) (py-libp2p's fixed rule): with 64 connections that was
    15 IHAVEs per id and node, more bytes than the records themselves."""

    def _get_adaptive_gossip_peers_count(self, topic: str, total_peers: int) -> int:
        return min(GOSSIP_PEERS, total_peers)


class _ContainedPubsub(Pubsub):
    """Pubsub whose per-peer work cannot fail the service: a peer whose stream or message
    raises is logged, its stream reset and the peer dropped from the mesh (and scored down
    by its invalid messages, as usual).

    It also counts what it has yet to send (``unsent``), for ``Gossip.flush``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sending: set[RpcQueue] = set()
        """Outbound queues whose peer's sending task runs: a queue left behind by a task
        that ended (its peer gone, or the service cancelled) is never written."""
        self.writing = 0
        """Messages taken from a queue and being written to their peer's stream now."""

    def unsent(self) -> int:
        """Messages queued for a running sending task, or being written."""
        return self.writing + sum(len(q) for q in self.sending)

    async def handle_sending_messages(
        self, peer_id: ID, stream: INetStream, queue: RpcQueue
    ) -> None:
        self.sending.add(queue)
        try:
            await super().handle_sending_messages(peer_id, stream, queue)
        finally:
            self.sending.discard(queue)

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        self.writing += 1
        try:
            return await super().write_msg(stream, rpc_msg)
        finally:
            self.writing -= 1

    async def continuously_read_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            await super().continuously_read_stream(stream)
        except Exception as exc:  # noqa: BLE001 - anything a peer's bytes can raise
            log.info(
                "gossip stream from a peer failed: dropped it",
                peer=str(peer),
                error=repr(exc)[:200],
            )
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
            log.info(
                "gossip message from a peer failed: dropped it",
                peer=str(msg_forwarder),
                error=repr(exc)[:200],
            )
