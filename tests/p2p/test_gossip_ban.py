"""Banning a liar never ends the gossip service: py-libp2p's teardown of a banned peer's
stream raced the peer's own read loop, and the KeyError it raised ended the daemon."""

from __future__ import annotations

import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from trio.testing import MockClock

from kvasird.p2p.gossip import Gossip


class _SlowStream:
    """A stream whose reset takes a moment, as a real one's does."""

    def __init__(self) -> None:
        self.reset_called = trio.Event()

    async def reset(self) -> None:
        self.reset_called.set()
        await trio.sleep(0.05)


def test_a_banned_peer_that_goes_away_during_its_teardown_leaves_gossip_running() -> None:
    gossip = Gossip(new_host(key_pair=create_new_key_pair()), "test")
    liar = ID.from_pubkey(create_new_key_pair().public_key)
    stream = _SlowStream()

    async def main() -> None:
        gossip.pubsub.peers[liar] = stream  # type: ignore[assignment]
        gossip.pubsub.peer_topics["kvasir/test/coverage"] = {liar}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gossip.pubsub._teardown_if_connected, liar)
            await stream.reset_called.wait()
            del gossip.pubsub.peers[liar]  # its read loop saw the stream close meanwhile
        assert liar not in gossip.pubsub.peers
        assert "kvasir/test/coverage" not in gossip.pubsub.peer_topics

    trio.run(main, clock=MockClock(autojump_threshold=0))  # the moment passes on its clock
