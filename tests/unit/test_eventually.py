"""The tests' one way to wait: ``eventually`` polls within a bound and, failing, says what it
waited for and what it last saw."""

from __future__ import annotations

import itertools

import pytest
import trio
from trio.testing import MockClock

from tests.support import eventually, eventually_async


def test_eventually_returns_the_first_truthy_value_of_the_probe() -> None:
    counts = itertools.count()
    assert eventually("the count reaches 3", lambda: max(next(counts) - 2, 0), timeout=5,
                      every=0) == 1


def test_a_wait_that_times_out_names_what_it_awaited_and_the_last_value_seen() -> None:
    replies: list[str] = []
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting until a reply "
                                             r"comes \(last seen: \[\]\)\nthe log"):
        eventually("a reply comes", lambda: replies, timeout=0.05, every=0.01,
                   context=lambda: "the log")


def test_exceptions_named_not_yet_are_retried_and_others_fail_at_once() -> None:
    answers = iter([KeyError("starting"), ValueError("half written"), "up"])

    def probe() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert eventually("it answers", probe, timeout=5, every=0,
                      not_yet=(KeyError, ValueError)) == "up"
    with pytest.raises(ZeroDivisionError):
        eventually("it answers", lambda: 1 / 0, timeout=5, every=0, not_yet=(KeyError,))


def test_a_wait_on_a_process_that_is_gone_gives_up_before_its_timeout() -> None:
    with pytest.raises(AssertionError, match=r"stopped early \(what it waited on is gone\) "
                                             r"waiting until the node serves"):
        eventually("the node serves", lambda: False, timeout=3600, alive=lambda: False)


async def test_the_async_wait_runs_on_trios_clock(autojump_clock: MockClock) -> None:
    start = trio.current_time()
    state = {"ready": False}

    async def get_ready() -> None:
        await trio.sleep(30)
        state["ready"] = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(get_ready)
        assert await eventually_async("it is ready", lambda: state["ready"], timeout=60)
    assert 30 <= trio.current_time() - start < 31  # virtual seconds
    with pytest.raises(AssertionError, match=r"timed out after 5 s waiting until it never is "
                                             r"\(last seen: False\)"):
        await eventually_async("it never is", lambda: False, timeout=5)
