"""A bare py-libp2p gossip peer for tests: not a kvasird, just enough to talk to one.

It answers kvasird's heartbeat (hello + pong) so it is not dropped as dead, and
publishes whatever bytes a test gives it on a network's gossip topics: load reports
of a pretend stage, or garbage and lies of an adversary. With ``lie_about_shards`` it
also answers the shard protocol, with bytes that are not the model's (a peer that claims
units it does not hold, and answers the challenges of its claims as best it can).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from kvasird import PROTOCOL_VERSION
from kvasird.wire import FrameReader, write_frame


class GossipPeer:
    def __init__(self, network: str) -> None:
        key = create_new_key_pair()
        self.network = network
        self.host = new_host(key_pair=key, muxer_preference="YAMUX",
                             sec_opt={NOISE_ID: NoiseTransport(key, noise_privkey=new_x25519().private_key)})
        self.router = GossipSub(["/meshsub/1.1.0"], 6, 4, 12, heartbeat_interval=1,
                                spam_protection_enabled=False)
        self.pubsub = Pubsub(self.host, self.router, strict_signing=True)
        self.peer_id = self.host.get_id().to_string()

    async def _heartbeat(self, stream) -> None:  # noqa: ANN001
        reader = FrameReader(stream)
        try:
            await reader.read()
            await write_frame(stream, {"op": "hello", "network": self.network,
                                       "protocol": PROTOCOL_VERSION, "version": "test",
                                       "addrs": self.advertised})
            while True:
                msg = await reader.read()
                await write_frame(stream, {"op": "pong", "n": msg["n"]})
        except Exception:  # noqa: BLE001 - the daemon hung up
            return

    async def _lying_shards(self, stream) -> None:  # noqa: ANN001
        """Every shard request answered "ok" with as many zero bytes as it asks for (32 for
        a proof), and counted in ``shard_requests``."""
        reader = FrameReader(stream)
        try:
            while True:
                request = await reader.read()
                self.shard_requests.append(request.get("op", "?"))
                n = 32 if request.get("op") == "prove" else sum(r[3] for r in request["ranges"])
                await write_frame(stream, {"ok": True, "len": n})
                await stream.write(bytes(n))
        except Exception:  # noqa: BLE001 - the daemon hung up
            return

    @asynccontextmanager
    async def running(self, join: str, *, lie_about_shards: bool = False
                      ) -> AsyncIterator[GossipPeer]:
        self.shard_requests: list[str] = []
        self.advertised: list[str] = []
        """Addresses told in the hello: a peer that lies about shards wants to be dialled."""
        if lie_about_shards:
            self.host.set_stream_handler("/kvasir/shard/1", self._lying_shards)
        self.host.set_stream_handler("/kvasir/heartbeat/1", self._heartbeat)
        async with self.host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]), \
                background_trio_service(self.pubsub), background_trio_service(self.router):
            await self.pubsub.wait_until_ready()
            if lie_about_shards:
                self.advertised = [str(a) for a in self.host.get_addrs()]
            await self.host.connect(info_from_p2p_addr(multiaddr.Multiaddr(join)))
            async with trio.open_nursery() as nursery:
                for name in ("coverage", "load"):
                    sub = await self.pubsub.subscribe(f"kvasir/{self.network}/{name}")
                    nursery.start_soon(self._drain, sub)
                await trio.sleep(2)  # let the mesh form
                yield self
                nursery.cancel_scope.cancel()
            for pid in list(self.host.get_connected_peers()):
                with trio.move_on_after(1):
                    await self.host.get_network().close_peer(pid)

    @staticmethod
    async def _drain(sub) -> None:  # noqa: ANN001
        """Read what the daemons gossip and drop it: an unread subscription fills its
        32-message queue, and py-libp2p then logs a warning for every message after."""
        while True:
            await sub.get()

    async def stay_connected(self, joins: list[str]) -> None:
        """Dial each of ``joins`` this peer has no connection to: a daemon drops a peer
        that answers its heartbeat late (a loaded machine), and then nothing this peer
        publishes reaches it, or anyone, if it was the only connection."""
        connected = {p.to_string() for p in self.host.get_connected_peers()}
        for join in joins:
            info = info_from_p2p_addr(multiaddr.Multiaddr(join))
            if info.peer_id.to_string() not in connected:
                with trio.move_on_after(5):
                    try:
                        await self.host.connect(info)
                    except Exception:  # noqa: BLE001 - it may be busy: the next round tries again
                        pass

    async def publish(self, name: str, data: bytes) -> None:
        with trio.move_on_after(5):
            await self.pubsub.publish(f"kvasir/{self.network}/{name}", data)

    async def send_raw_rpc(self, peer_id: str, payload: bytes) -> None:
        """Write ``payload`` as one length-prefixed pubsub RPC on a new gossip stream to the
        peer: bytes that need not parse (an adversary's)."""
        from libp2p.peer.id import ID
        from libp2p.utils import encode_varint_prefixed

        stream = await self.host.new_stream(ID.from_base58(peer_id), ["/meshsub/1.1.0"])
        await stream.write(encode_varint_prefixed(payload))
