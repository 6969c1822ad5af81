"""Bootstrap redialling on trio's virtual clock: a peer that refuses is tried again after
waits that double up to a minute, and once it answers it is not dialled again."""

from __future__ import annotations

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from trio.testing import MockClock

from kvasird.p2p.dialer import BACKOFF_MAX_S, Dialer


class Host:
    """What the dialer uses of a libp2p host; connections are refused until `answering`."""

    def __init__(self) -> None:
        self.id = ID.from_pubkey(create_new_key_pair().public_key)
        self.dials: list[float] = []
        self.answering = False
        self.connected: list[ID] = []

    def get_id(self) -> ID:
        return self.id

    def get_connected_peers(self) -> list[ID]:
        return self.connected

    def get_peerstore(self) -> Host:
        return self  # it keeps no addresses: nothing for the dialer to clear

    def clear_addrs(self, peer_id: ID) -> None:
        pass

    async def connect(self, info: PeerInfo) -> None:
        self.dials.append(trio.current_time())
        if not self.answering:
            raise OSError("connection refused")
        self.connected.append(info.peer_id)


async def test_a_refusing_bootstrap_peer_is_redialled_after_doubling_waits(
        autojump_clock: MockClock) -> None:
    host = Host()
    peer = ID.from_pubkey(create_new_key_pair().public_key).to_string()
    async with trio.open_nursery() as nursery:
        await nursery.start(Dialer(host, 8).keep_bootstrapped,
                            (f"/ip4/127.0.0.1/tcp/4001/p2p/{peer}",), [])
        await trio.sleep(250)
        gaps = [b - a for a, b in zip(host.dials, host.dials[1:], strict=False)]
        assert len(gaps) >= 7
        for n, gap in enumerate(gaps):  # the loop looks once a second; waits vary +-20 %
            want = min(2.0 ** n, BACKOFF_MAX_S)
            assert 0.8 * want <= gap <= 1.2 * want + 1, (n, gaps)
        host.answering = True
        dials = len(host.dials)
        await trio.sleep(2 * BACKOFF_MAX_S)
        assert len(host.dials) == dials + 1  # connected: kept, not redialled
        nursery.cancel_scope.cancel()
