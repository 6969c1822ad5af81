"""Download progress: the rate and ETA arithmetic on an explicit clock, when a log event is
due, the terminal bar, and the per-unit numbers a real download reports."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from kvasird.model.manifest import Unit
from kvasird.model.progress import LogPacer, Meter, TerminalBar, format_eta, mb_s
from kvasird.model.transfer import Progress, download

MB = 10**6


def test_rate_and_eta_follow_the_recent_window():
    meter = Meter(total=100 * MB, done=0, now=0.0, window_s=5.0)
    assert meter.rate == 0.0 and meter.eta_s is None
    for t in range(1, 6):
        meter.update(10 * MB * t, float(t))
    assert meter.rate == pytest.approx(10 * MB)
    assert meter.eta_s == pytest.approx(5.0)
    for t in range(6, 11):  # the holder slows to 2 MB/s: the old samples leave the window
        meter.update(50 * MB + 2 * MB * (t - 5), float(t))
    assert meter.rate == pytest.approx(2 * MB)
    assert meter.eta_s == pytest.approx(40 * MB / (2 * MB))


def test_a_finished_meter_has_no_time_left_and_a_stalled_one_no_eta():
    meter = Meter(total=10, done=4, now=0.0)
    meter.update(4, 10.0)
    assert meter.rate == 0.0 and meter.eta_s is None and meter.fraction == 0.4
    meter.update(10, 11.0)
    assert meter.eta_s == 0.0 and meter.fraction == 1.0


def test_resumed_bytes_are_not_counted_as_speed():
    meter = Meter(total=100, done=60, now=0.0)
    meter.update(70, 2.0)
    assert meter.rate == 5.0 and meter.eta_s == 6.0


def test_log_events_come_each_tenth_or_every_few_seconds_and_once_at_the_end():
    pacer = LogPacer(now=0.0, every_s=5.0, step=0.1)
    assert not pacer.due(0.05, 1.0)
    assert pacer.due(0.12, 1.5)           # crossed 10 %
    assert not pacer.due(0.15, 2.0)
    assert pacer.due(0.16, 6.5)           # 5 s passed
    assert pacer.due(0.45, 6.6)           # crossed 20 %, 30 % and 40 % at once: one event
    assert not pacer.due(0.49, 6.7)
    assert pacer.due(1.0, 6.8)            # the end
    assert not pacer.due(1.0, 20.0)       # and only once


def test_eta_and_rate_are_written_for_people():
    assert format_eta(None) == "-:--"
    assert format_eta(0.2) == "0:01"
    assert format_eta(65) == "1:05"
    assert format_eta(3725) == "1:02:05"
    assert mb_s(12_345_678) == 12.3


def test_the_bar_shows_bytes_rate_and_eta(capsys):
    meter = Meter(total=50 * MB, done=0, now=0.0)
    meter.update(20 * MB, 2.0)
    with TerminalBar("shards", meter.total, enabled=True) as bar:
        bar.show(meter)
    err = capsys.readouterr().err
    assert "shards" in err and "20.0/50.0 MB" in err and "10.0 MB/s" in err and "eta 0:03" in err


def test_no_bar_off_a_terminal(capsys):
    meter = Meter(total=10, done=0, now=0.0)
    with TerminalBar("shards", 10, enabled=False) as bar:
        bar.show(meter)
    assert capsys.readouterr().err == ""


async def test_a_download_reports_each_unit_and_logs_its_progress(
        swarm, source_store, store_factory, moe_manifest):
    mid = moe_manifest.model_id
    units = [Unit("layer", 0), Unit("layer", 1), *(Unit("expert", 1, e) for e in range(8))]
    learner = store_factory("learner")
    seen: list[Progress] = []
    with capture_logs() as logs:
        await download(learner, mid, units, [swarm.add("a", source_store)], swarm.open_stream,
                       progress=seen.append)
    last = seen[-1]
    assert last.finished and last.done_bytes == last.total_bytes
    assert [u.unit for u in last.units] == sorted(units)
    assert all(u.done_bytes == u.total_bytes > 0 for u in last.units)
    assert sum(u.total_bytes for u in last.units) == last.total_bytes
    events = [e for e in logs if e["event"] == "shard download progress"]
    assert events and events[-1]["bytes"] == events[-1]["total"] == last.total_bytes
    assert events[-1]["units_done"] == events[-1]["units"] == len(units)
    assert {"unit", "mb_s", "eta_s", "pct"} <= set(events[-1])
    assert [e["bytes"] for e in events] == sorted(e["bytes"] for e in events)
