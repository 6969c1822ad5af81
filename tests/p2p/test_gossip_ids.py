"""Gossip message ids across a restart: (signer, seqno), so a new process must not reuse
the seqnos its old one published under the same peer id."""

from __future__ import annotations

import time

import pytest
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair

from kvasird.p2p.gossip import Gossip


def test_a_restarted_node_numbers_its_messages_past_the_old_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The old process published 5,000 messages in 2,500 s (2 a second), then restarted.
    py-libp2p counts seqnos from the start time in seconds: the new process would start
    2,500 short of the old one's last and reuse the ids its peers had seen."""
    start = 1_800_000_000.0

    def at(t: float) -> None:
        monkeypatch.setattr(time, "time", lambda: t)
        monkeypatch.setattr(time, "time_ns", lambda: int(t * 1e9))

    key = create_new_key_pair()  # one node key: the same peer id before and after
    at(start)
    old = Gossip(new_host(key_pair=key), "test")
    last = [old.pubsub._next_seqno() for _ in range(5_000)][-1]
    at(start + 2_500.0)
    new = Gossip(new_host(key_pair=key), "test")
    assert int.from_bytes(new.pubsub._next_seqno(), "big") > int.from_bytes(last, "big")
