"""The WAN emulator's scheduling (bench/wan_link.py): delay, loss, rate and order on each
link, and a learning switch's forwarding, driven by the time given to it (no sockets); and,
where network namespaces can be made (root), the bridge itself between two of them."""

from __future__ import annotations

import itertools
import os
import random
import statistics
import subprocess

import pytest

from bench.wan_link import Link, LinkSettings, Switch

MAC = [bytes([0x02, 0, 0, 0, 0, i]) for i in range(4)]
BROADCAST = b"\xff" * 6


def frame(dst: bytes, src: bytes, tag: int, size: int = 64) -> bytes:
    return dst + src + b"\x08\x00" + tag.to_bytes(4, "big") + bytes(size - 18)


def tags(frames: list[bytes]) -> list[int]:
    return [int.from_bytes(f[14:18], "big") for f in frames]


def test_a_frame_arrives_one_way_delay_after_it_came_and_not_before() -> None:
    link = Link(LinkSettings(delay_s=0.020))
    assert link.admit(1.0, frame(MAC[1], MAC[0], 7), draw=0.5)
    assert link.due(1.0199) == []
    assert link.next_arrival() == pytest.approx(1.020)
    assert tags(link.due(1.020)) == [7]
    assert link.forwarded == 1


def test_a_frame_never_overtakes_an_earlier_one_when_the_delay_drops_in_flight() -> None:
    link = Link(LinkSettings(delay_s=0.040))
    link.admit(0.0, frame(MAC[1], MAC[0], 1), draw=0.5)
    link.settings = LinkSettings(delay_s=0.0)
    link.admit(0.001, frame(MAC[1], MAC[0], 2), draw=0.5)
    assert link.due(0.039) == []
    assert tags(link.due(0.040)) == [1, 2]


def test_a_link_loses_the_fraction_of_frames_its_loss_says() -> None:
    draw = random.Random(7).random
    link = Link(LinkSettings(loss=0.01))
    sent = 100_000
    for i in range(sent):
        link.admit(i * 1e-4, frame(MAC[1], MAC[0], i), draw())
        link.due(i * 1e-4)
    assert link.lost + link.forwarded == sent
    assert 0.009 < link.lost / sent < 0.011
    assert all(Link(LinkSettings(loss=0.0)).admit(0.0, b"x" * 64, d) for d in (0.0, 0.999))
    assert not Link(LinkSettings(loss=1.0)).admit(0.0, b"x" * 64, 0.999)


def test_a_paced_link_lets_a_burst_go_then_one_frame_per_frame_time() -> None:
    # 1 Mbit/s: a 1250-byte frame takes 10 ms; the bucket holds two frames.
    link = Link(LinkSettings(rate_bps=1e6, burst_bytes=2500))
    for i in range(5):
        link.admit(0.0, frame(MAC[1], MAC[0], i, size=1250), draw=0.5)
    arrivals = [t for t, _ in link.queue]
    assert arrivals == pytest.approx([0.0, 0.0, 0.010, 0.020, 0.030])


def test_a_paced_link_refills_while_idle_but_never_past_its_burst() -> None:
    link = Link(LinkSettings(rate_bps=1e6, burst_bytes=2500))
    link.admit(0.0, frame(MAC[1], MAC[0], 0, size=2500), draw=0.5)
    for i in range(1, 4):  # a second later the bucket is full again: two frames go at once
        link.admit(1.0, frame(MAC[1], MAC[0], i, size=1250), draw=0.5)
    assert [t for t, _ in link.queue] == pytest.approx([0.0, 1.0, 1.0, 1.010])


def test_a_paced_link_with_delay_holds_each_frame_after_it_leaves() -> None:
    link = Link(LinkSettings(delay_s=0.005, rate_bps=1e6, burst_bytes=1250))
    for i in range(3):
        link.admit(0.0, frame(MAC[1], MAC[0], i, size=1250), draw=0.5)
    assert [t for t, _ in link.queue] == pytest.approx([0.005, 0.015, 0.025])


def test_a_full_link_drops_what_comes_next() -> None:
    link = Link(LinkSettings(delay_s=1.0, queue_frames=3))
    kept = [link.admit(0.0, frame(MAC[1], MAC[0], i), draw=0.5) for i in range(5)]
    assert kept == [True, True, True, False, False]
    assert link.dropped == 2


def test_an_unknown_destination_floods_and_a_learned_one_goes_to_its_port_only() -> None:
    switch = Switch(3, draw=lambda: 0.5)
    switch.receive(0.0, 0, frame(MAC[1], MAC[0], 1))
    assert sorted(port for port, _ in switch.due(0.0)) == [1, 2]
    switch.receive(0.1, 1, frame(MAC[0], MAC[1], 2))  # the answer: MAC 0 is on port 0
    assert [(port, tags([f])[0]) for port, f in switch.due(0.1)] == [(0, 2)]
    switch.receive(0.2, 0, frame(MAC[1], MAC[0], 3))  # and MAC 1 on port 1
    assert [(port, tags([f])[0]) for port, f in switch.due(0.2)] == [(1, 3)]


def test_a_broadcast_reaches_every_other_port() -> None:
    switch = Switch(4, draw=lambda: 0.5)
    switch.receive(0.0, 2, frame(BROADCAST, MAC[2], 1))
    assert sorted(port for port, _ in switch.due(0.0)) == [0, 1, 3]


def test_a_frame_for_the_port_it_came_from_is_not_sent_back() -> None:
    switch = Switch(2, draw=lambda: 0.5)
    switch.receive(0.0, 0, frame(BROADCAST, MAC[0], 1))
    switch.due(0.0)
    switch.receive(0.0, 0, frame(MAC[0], MAC[3], 2))
    assert switch.due(1.0) == []


def test_each_pair_of_ports_has_its_own_delay() -> None:
    switch = Switch(3, draw=lambda: 0.5)
    switch.apply('{"default": {"delay_ms": 40}, "links": [{"from": 0, "to": 1, "delay_ms": 5}]}')
    switch.receive(0.0, 0, frame(BROADCAST, MAC[0], 1))
    assert switch.next_arrival() == pytest.approx(0.005)
    assert [port for port, _ in switch.due(0.005)] == [1]
    assert switch.due(0.039) == []
    assert [port for port, _ in switch.due(0.040)] == [2]
    assert switch.links[(1, 0)].settings.delay_s == pytest.approx(0.040)


def test_a_control_line_sets_loss_and_rate_in_its_units_and_keeps_the_others() -> None:
    switch = Switch(2)
    switch.apply(
        '{"default": {"delay_ms": 20, "loss": 0.01, "rate_mbit": 10}, '
        '"links": [{"from": 1, "to": 0, "loss": 0}]}'
    )
    there, back = switch.links[(0, 1)].settings, switch.links[(1, 0)].settings
    assert (there.delay_s, there.loss, there.rate_bps) == pytest.approx((0.020, 0.01, 1e7))
    assert (back.delay_s, back.loss, back.rate_bps) == pytest.approx((0.020, 0.0, 1e7))


def test_frames_on_each_link_leave_in_the_order_they_came_whatever_the_settings() -> None:
    draw = random.Random(3).random
    switch = Switch(3, draw=draw)
    switch.receive(0.0, 1, frame(BROADCAST, MAC[1], 0))
    switch.receive(0.0, 2, frame(BROADCAST, MAC[2], 0))
    switch.due(1.0)
    delays = itertools.cycle([0, 40, 5, 20])
    seen: list[int] = []
    for i in range(1, 400):
        if i % 37 == 0:
            switch.apply(f'{{"default": {{"delay_ms": {next(delays)}, "rate_mbit": 2}}}}')
        switch.receive(i * 0.001, 0, frame(MAC[1], MAC[0], i, size=200 + (i * 97) % 1300))
        seen += tags([f for _, f in switch.due(i * 0.001)])
    seen += tags([f for _, f in switch.due(1e9)])
    assert seen == sorted(seen) and len(seen) == 399
    assert switch.counts() == {"forwarded": 4 + 399, "lost": 0, "dropped": 0, "unsent": 0}


@pytest.mark.slow
def test_udp_between_two_namespaces_takes_the_links_delay_and_loss() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    from bench.bench_wan import Wan  # the benchmark's own namespaces and bridge

    wan = Wan.create(2)
    try:
        wan.itself(n=5)
        wan.links(20.0, 0.0)
        assert 40.0 <= statistics.median(wan.round_trips(10)) < 60.0
        wan.links(0.0, 1.0)
        assert wan.round_trips(2) == []
        assert wan.links(0.0, 0.0)["lost"] >= 2
    finally:
        wan.destroy()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert wan.lan.tag not in listed
