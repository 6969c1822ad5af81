"""Dial-back: the verdict rule, the operator's advice, and real probes between two hosts."""

from __future__ import annotations

import sqlite3

import trio
from libp2p.peer.peerinfo import PeerInfo

from kvasird.p2p.peers import PeerTable
from kvasird.p2p.reachability import DialBack, Reachability, advice, decide

A = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWA"


def test_majority_of_answering_peers_decides() -> None:
    assert decide(3, [(A,), (A,), ()]).verdict == "public"
    assert decide(3, [(), ()]).verdict == "private"
    assert decide(2, [(A,), ()]).verdict == "unknown"
    assert decide(3, []).verdict == "unknown"
    assert decide(3, [(A,), (A,)]).reached == (A,)


def test_private_advice_names_the_port_the_config_key_and_relays() -> None:
    text = advice(Reachability("private"), [A], "/var/lib/kvasird/kvasird.toml")
    assert "forward TCP port 4001" in text
    assert "[p2p] announce in /var/lib/kvasird/kvasird.toml" in text
    assert "relays" in text


def _dialback(host, psk=None) -> DialBack:  # noqa: ANN001
    return DialBack(host, PeerTable(sqlite3.connect(":memory:")), lambda: [], psk, 60.0,
                    lambda r: None, "kvasird.toml")


async def test_probe_reaches_a_listening_peer_and_not_a_closed_port_or_an_impostor(hosts) -> None:  # noqa: ANN001
    async with hosts([None, None, None]) as (prober, target, other):
        target_addr = f"{target.get_addrs()[0]}"
        if "/p2p/" not in target_addr:
            target_addr += f"/p2p/{target.get_id()}"
        dialback = _dialback(prober)
        assert await dialback.probe(target_addr, target.get_id())
        closed = target_addr.replace(target_addr.split("/")[4], "1", 1)
        assert not await dialback.probe(closed, target.get_id())
        # Someone else listens there: the Noise handshake proves it is not the asker.
        assert not await dialback.probe(target_addr, other.get_id())
        # The probe never registers a connection on either side.
        assert target.get_id() not in prober.get_network().connections


async def test_peer_refuses_to_probe_an_address_other_than_where_the_asker_comes_from(
        hosts) -> None:  # noqa: ANN001
    async with hosts([None, None]) as (asker, server), trio.open_nursery() as nursery:
        await nursery.start(_dialback(server).run)
        await _ask_from(asker, server)
        nursery.cancel_scope.cancel()


async def _ask_from(asker, server) -> None:  # noqa: ANN001
    await asker.connect(PeerInfo(server.get_id(), server.get_addrs()))
    mine = f"{asker.get_addrs()[0]}/p2p/{asker.get_id()}"
    elsewhere = f"/ip4/192.0.2.9/tcp/4001/p2p/{asker.get_id()}"  # TEST-NET-1, never dialled
    not_mine = f"{server.get_addrs()[0]}/p2p/{server.get_id()}"
    with trio.fail_after(15):
        reached = await _dialback(asker)._ask(server.get_id().to_string(),
                                              [mine, elsewhere, not_mine])
    assert reached == (mine,)
