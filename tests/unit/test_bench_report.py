"""bench/REPORT.md as bench/run_all.py builds it from stored results: one section per
benchmark, a summary that reads the same verdicts, and nothing dropped silently. The
benchmarks here are small scripts run as run_all runs the real ones."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bench.run_all import BENCHES, Bench, Check, Result, execute, judge, render, run, store, stored
from tests.support import eventually

SHARDS = Bench("shards", "Shard transfer", ("bench_shards.py",), ("bench_shards.py",),
               ">= 100 MB/s on loopback",
               (Check("shard download MB/s", r"^\| shard download +\|.*\| +([\d.]+) \|$", 100.0),))
SLOW = Bench("slow", "A benchmark under its target", ("bench_slow.py",), ("bench_slow.py",),
             ">= 100 MB/s on loopback", SHARDS.checks)
RELAY = Bench("relay", "Relayed vs direct RTT and throughput", ("bench_relay.py",),
              ("bench_relay.py",), "relayed path usable for latency-tolerant work")
BROKEN = Bench("broken", "A benchmark that fails", ("bench_broken.py",), ("bench_broken.py",),
               "anything")
HUNG = Bench("hung", "A benchmark that never ends", ("bench_hung.py",), ("bench_hung.py",),
             "anything", timeout_s=1.0)
GONE = Bench("gone", "A benchmark whose script is missing", ("bench_gone.py",),
             ("bench_gone.py",), "anything")
NEVER = Bench("never", "A benchmark never run", ("bench_never.py",), ("bench_never.py",),
              "anything")
FIXTURE = (SHARDS, SLOW, RELAY, BROKEN, HUNG, GONE, NEVER)

TABLE = """print('''model: SmolLM2-135M-Instruct.Q4_1.gguf; best of 1 run(s)

| path           |       MB |  seconds |     MB/s |
|----------------|----------|----------|----------|
| shard download |     96.6 |    0.705 |    {mbs} |
## a markdown heading a script printed
''')
"""
SCRIPTS = {
    "bench_shards.py": TABLE.format(mbs=136.9),
    "bench_slow.py": TABLE.format(mbs=61.2),
    "bench_relay.py": "print('| direct | 7.6 |')\n",
    "bench_broken.py": "print('half a table')\nraise SystemExit('the daemon did not start')\n",
    "bench_hung.py": "import time\nprint('started', flush=True)\ntime.sleep(60)\n",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every fixture benchmark run (NEVER left out), stored, read back and rendered."""
    scripts, results = tmp_path_factory.mktemp("scripts"), tmp_path_factory.mktemp("results")
    for name, text in SCRIPTS.items():
        (scripts / name).write_text(text)
    for bench in FIXTURE[:-1]:
        store(run(bench, quick=True, timeout_s=None, scripts=scripts), results)
    return render(FIXTURE, stored(results))


def headings(report: str) -> list[str]:
    """The report's markdown headings, outside its fenced blocks of benchmark output."""
    found, fenced = [], False
    for line in report.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.append(line)
    return found


def summary_verdicts(report: str) -> dict[str, str]:
    """The summary table's verdict column, by benchmark (the table before any section)."""
    summary = report.split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in summary.splitlines() if line.startswith("| ")]
    return {cells[0][2:]: cells[1] for cells in rows[1:]}


def section_verdicts(report: str) -> dict[str, str]:
    """Each section's verdict, by benchmark."""
    titles = {bench.title: bench.name for bench in FIXTURE}
    sections = re.findall(r"^## (.+)\n\nTarget: .*\nVerdict: ([a-z]+(?: [a-z]+)*)", report,
                          re.MULTILINE)
    return {titles[title]: verdict for title, verdict in sections}


def test_no_heading_repeats_in_a_report_of_every_benchmark(report: str) -> None:
    assert len(headings(report)) == len(set(headings(report))) == len(FIXTURE) + 1


def test_the_benchmarks_run_all_knows_have_distinct_names_and_headings() -> None:
    assert len({bench.name for bench in BENCHES}) == len(BENCHES)
    assert len({bench.title for bench in BENCHES}) == len(BENCHES)


def test_the_summary_reads_every_sections_verdict(report: str) -> None:
    assert summary_verdicts(report) == section_verdicts(report) == {
        "shards": "met", "slow": "not met", "relay": "unjudged", "broken": "failed",
        "hung": "timed out", "gone": "missing", "never": "not run"}


def test_a_number_below_its_target_is_named_in_the_verdict(report: str) -> None:
    assert "Verdict: not met (shard download MB/s 61.2 (target >= 100))." in report
    assert "Verdict: met (shard download MB/s 136.9 (target >= 100))." in report


def test_a_failed_benchmark_shows_its_output_and_why_it_failed(report: str) -> None:
    assert "Verdict: failed (exit 1;" in report
    assert "half a table\n\nthe daemon did not start" in report


def test_a_missing_or_unrun_benchmark_is_reported_with_what_to_do(report: str) -> None:
    assert "bench/bench_gone.py does not exist" in report
    assert "`.venv/bin/python bench/run_all.py --only never`" in report


def test_a_run_whose_output_lacks_the_targets_number_is_unjudged() -> None:
    assert judge(SHARDS, "llama.cpp: not built") == (
        "unjudged", "not in the output: shard download MB/s")


def test_a_benchmark_stopped_at_its_bound_takes_the_processes_it_started_down() -> None:
    code, out, _ = execute(["sh", "-c", "sleep 60 & echo $!; wait"], timeout_s=2.0)
    assert code is None
    child = int(out.split()[0])
    eventually(f"process {child} gone", lambda: not running(child), timeout=10.0)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_result_file_reads_back_as_it_was_stored(tmp_path: Path) -> None:
    result = Result("relay", ".venv/bin/python bench/bench_relay.py", False, "AMD EPYC",
                    "0de0b73", "2026-12-07 03:00", 8.4, "unjudged", "no number", "| a | b |")
    store(result, tmp_path)
    assert stored(tmp_path) == {"relay": result}
    assert os.listdir(tmp_path) == ["relay.json"]
