"""A foreign gateway: a bare py-libp2p peer (GossipPeer) that a daemon takes for a staked
gateway, with no kvasird behind it, so a test decides every frame it sends.

It announces itself as a gateway does: a coverage record of its own, signed by its peer
key on the gossip topic, holding nothing and carrying the wallet's signed link to its peer
id. A daemon admits it once that wallet holds the stake minimum on chain; what it then
steps, and which receipts (signed by the wallet) it sends, are the test's choice.
"""

from __future__ import annotations

import time
from typing import Any

from gossip_peer import GossipPeer  # type: ignore[import-not-found]
from solders.keypair import Keypair

from kvasird import PROTOCOL_VERSION
from kvasird.market.records import CoverageRecord
from kvasird.settlement.receipts import Receipt, receipt_body
from kvasird.settlement.wallet import sign_link
from kvasird.wire import pack

RECORD_TTL_S = 600.0
"""Longer than a test runs: a record that holds nothing is never suspected, and lives its
TTL without keep-alives."""


class ForeignGateway(GossipPeer):
    def __init__(self, network: str, wallet: Keypair) -> None:
        super().__init__(network)
        self.wallet = wallet
        self.link = sign_link(wallet, self.peer_id, network)
        self.seq = 0
        """The last coverage record's sequence number."""

    def record(self) -> CoverageRecord:
        """A fresh record of a gateway that holds nothing and is paid at ``wallet``."""
        self.seq += 1
        return CoverageRecord(peer=self.peer_id, seq=self.seq, ts=time.time(),
                              ttl=RECORD_TTL_S, state="online", protocol=PROTOCOL_VERSION,
                              version="test", addrs=(), model="", budget=0, holdings=(),
                              link=self.link)

    async def announce(self) -> None:
        await self.publish("coverage", pack(self.record().to_wire()))

    def receipt(self, peer: str, epoch: int, units: int, amount: int, seq: int
                ) -> dict[str, Any]:
        """The wallet's cumulative receipt to ``peer``, in its wire form: whatever units and
        amount the test names, signed as a gateway signs them."""
        gateway = self.wallet.pubkey()
        body = receipt_body(self.network, gateway, peer, epoch, units, amount, seq)
        return Receipt(self.network, gateway, peer, epoch, units, amount, seq,
                       self.wallet.sign_message(body)).to_wire()
