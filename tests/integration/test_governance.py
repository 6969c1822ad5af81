"""Network parameters travel by gossip and change only under the genesis wallet's signature."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import trio
from gossip_peer import GossipPeer  # type: ignore[import-not-found]
from solders.keypair import Keypair

from kvasird.localnet import LocalNet
from kvasird.settlement.governance import sign_governance
from kvasird.settlement.localchain.genesis import load_or_create_genesis
from kvasird.settlement.pricing import GENESIS_PARAMS
from kvasird.wire import pack

pytestmark = pytest.mark.slow


def test_only_the_genesis_wallet_changes_network_parameters(localnet: Callable[..., LocalNet]) -> None:
    net = localnet(3, settings={"gateway.enabled": False}, chain=True)
    net.up()
    net.wait_until("all three are connected", net.fully_connected, timeout=30)
    genesis, _ = load_or_create_genesis(net.chain.data / "genesis.json")  # type: ignore[union-attr]
    raised = dataclasses.replace(GENESIS_PARAMS, version=GENESIS_PARAMS.version + 1,
                                 floor=GENESIS_PARAMS.floor * 2,
                                 ceiling=max(GENESIS_PARAMS.ceiling, GENESIS_PARAMS.floor * 2))
    forged = sign_governance(Keypair(), "localnet", dataclasses.replace(raised, floor=1))
    wrong_net = sign_governance(genesis.authority, "othernet", raised)
    real = sign_governance(genesis.authority, "localnet", raised)

    def applied() -> bool:
        return all(n.get("/v0/settlement")["params"]["version"] == raised.version
                   for n in net.nodes)

    async def announce() -> None:
        peer = GossipPeer("localnet")
        async with peer.running(net.nodes[0].join_addr):
            for message in (forged, wrong_net, real):
                await peer.pubsub.publish("kvasir/localnet/governance", pack(message.to_wire()))
                await trio.sleep(0.5)
            # connected until the nodes have it: the last message is not lost on hanging up
            await trio.to_thread.run_sync(
                net.wait_until, "every node applies the genesis-signed parameters", applied, 20)

    trio.run(announce)
    for node in net.nodes:
        assert node.get("/v0/settlement")["params"]["floor"] == raised.floor
    log = net.nodes[0].log.read_text()
    assert "not signed by the genesis wallet" in log and "is for network 'othernet'" in log
