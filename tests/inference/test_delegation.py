"""Delegations: a gateway's signed word, checked by a worker with the gateway's peer id alone."""

from __future__ import annotations

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from kvasird.inference.errors import Refusal
from kvasird.inference.protocol import delegation
from kvasird.inference.protocol.delegation import Delegation, Issuer, Verifier, life_s
from kvasird.wire import pack
from tests.support import Clock


@pytest.fixture
def clock() -> Clock:
    """Wall time a test moves by hand."""
    return Clock(1_800_000_000.0)


def issuer(clock: Clock, network: str = "testnet") -> Issuer:
    return Issuer(create_new_key_pair(), network, clock)


def refused(verifier: Verifier, wire: bytes, caller: str, why: str) -> None:
    with pytest.raises(Refusal, match=why) as exc:
        verifier.check(wire, caller)
    assert exc.value.code == "unpaid"


def test_a_signed_delegation_lets_its_delegate_send_rows_for_the_gateway(clock: Clock) -> None:
    gateway, stage = issuer(clock), issuer(clock)
    wire = gateway.issue(stage.peer_id, 300)
    d = Verifier("testnet", clock).check(wire, stage.peer_id)
    assert d == Delegation("testnet", gateway.peer_id, stage.peer_id, clock.now + 300)
    assert len(wire) <= delegation.MAX_BYTES


def test_a_delegation_to_another_stage_is_refused(clock: Clock) -> None:
    gateway, stage, thief = issuer(clock), issuer(clock), issuer(clock)
    refused(Verifier("testnet", clock), gateway.issue(stage.peer_id, 300), thief.peer_id,
            "names another stage")


def test_an_expired_delegation_is_refused_and_says_to_open_again(clock: Clock) -> None:
    gateway, stage = issuer(clock), issuer(clock)
    verifier = Verifier("testnet", clock)
    wire = gateway.issue(stage.peer_id, 300)
    verifier.check(wire, stage.peer_id)
    clock.now += 301  # remembered as verified, still checked for its expiry at every use
    refused(verifier, wire, stage.peer_id, "expired 1 s ago: the gateway must open")


def test_a_forged_or_altered_delegation_is_refused(clock: Clock) -> None:
    """Signed by someone else in the gateway's name, or re-dated after signing."""
    gateway, stage, forger = issuer(clock), issuer(clock), issuer(clock)
    verifier = Verifier("testnet", clock)
    body = Delegation("testnet", gateway.peer_id, stage.peer_id, clock.now + 300).body()
    forged = body + forger.key.private_key.sign(delegation.DOMAIN + body)
    refused(verifier, forged, stage.peer_id, f"not signed by gateway {gateway.peer_id}")
    wire = gateway.issue(stage.peer_id, 300)
    longer = Delegation("testnet", gateway.peer_id, stage.peer_id, clock.now + 9000).body()
    refused(verifier, longer + wire[-delegation.SIGNATURE_BYTES:], stage.peer_id,
            "not signed by gateway")
    flipped = wire[:-1] + bytes([wire[-1] ^ 1])
    refused(verifier, flipped, stage.peer_id, "not signed by gateway")


def test_a_name_that_is_no_peer_id_or_garbage_is_refused(clock: Clock) -> None:
    stage = issuer(clock)
    verifier = Verifier("testnet", clock)
    body = Delegation("testnet", "gw1", stage.peer_id, clock.now + 300).body()
    refused(verifier, body + bytes(64), stage.peer_id, "not signed by gateway gw1")
    for garbage in (b"", b"x" * 10, pack(["testnet", "gw1"]) + bytes(64),
                    pack(["testnet", "gw1", stage.peer_id, 5]) + bytes(64)):
        refused(verifier, garbage, stage.peer_id, "malformed")


def test_a_delegation_of_another_network_or_too_long_a_life_is_refused(clock: Clock) -> None:
    gateway, stage = issuer(clock, "othernet"), issuer(clock)
    refused(Verifier("testnet", clock), gateway.issue(stage.peer_id, 300), stage.peer_id,
            "signed for network 'othernet'")
    gateway = issuer(clock)
    refused(Verifier("testnet", clock), gateway.issue(stage.peer_id, 2 * delegation.MAX_LIFE_S),
            stage.peer_id, "longer than")


def test_a_session_that_may_generate_more_has_its_delegation_live_longer() -> None:
    assert life_s(1) < life_s(4096) < life_s(1 << 22) == delegation.MAX_LIFE_S
    assert life_s(1) >= delegation.BASE_LIFE_S


def test_a_nodes_own_delegation_is_reused_then_renewed_before_it_ends(clock: Clock) -> None:
    me = issuer(clock)
    verifier = Verifier("testnet", clock)
    first = me.own()
    assert me.own() == first
    assert verifier.check(first, me.peer_id).gateway == me.peer_id
    clock.now += delegation.BASE_LIFE_S - delegation.OWN_RENEW_S + 1
    renewed = me.own()
    assert renewed != first and verifier.check(renewed, me.peer_id).expires > clock.now + 60
