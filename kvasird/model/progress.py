"""Progress of long byte jobs (shard downloads, ``kvasird model add``): numbers, log lines, a bar.

    Meter          bytes done of a total over time → recent rate (bytes/s) and ETA; the one
                   place the arithmetic lives, fed an explicit clock so it can be tested
    LogPacer       when a periodic ``... progress`` log event is due: every ``every_s``
                   seconds or each ``step`` of the total, and once at the end
    TerminalBar    a rich progress bar on stderr when stderr is a terminal (bytes, MB/s,
                   ETA from a Meter); nothing at all otherwise

``rich`` is imported only when a bar is really shown, so commands that never download
start as fast as before.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import deque
from typing import Any

RATE_WINDOW_S = 5.0
"""The rate is measured over the last few seconds: recent enough to follow a holder that
slows down, long enough not to jump with each chunk."""


class Meter:
    """Bytes done of ``total`` over time; ``now`` is any monotonic clock in seconds."""

    def __init__(self, total: int, done: int, now: float, window_s: float = RATE_WINDOW_S) -> None:
        self.total, self.done = total, done
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque([(now, done)])

    def update(self, done: int, now: float) -> None:
        self.done = done
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    @property
    def rate(self) -> float:
        """Bytes per second over the window (0.0 before time has passed)."""
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the recent rate; 0.0 when done, None while there is no rate."""
        left = self.total - self.done
        if left <= 0:
            return 0.0
        rate = self.rate
        return left / rate if rate > 0 else None

    @property
    def fraction(self) -> float:
        return 1.0 if self.total <= 0 else min(1.0, self.done / self.total)


class LogPacer:
    """Decides when the next periodic progress event is due."""

    def __init__(self, now: float, every_s: float = 5.0, step: float = 0.1) -> None:
        self.every_s, self.step = every_s, step
        self._last_t = now
        self._last_step = 0
        self._finished = False

    def due(self, fraction: float, now: float) -> bool:
        """True (and counted as logged) when ``every_s`` passed since the last event, a new
        ``step`` of the total was crossed, or the job just reached its end."""
        if self._finished:
            return False
        steps = math.floor(fraction / self.step + 1e-9)
        if fraction >= 1.0 or steps > self._last_step or now - self._last_t >= self.every_s:
            self._finished = fraction >= 1.0
            self._last_t, self._last_step = now, max(steps, self._last_step)
            return True
        return False


def mb_s(rate: float) -> float:
    """A rate in bytes/s as MB/s for logs and views (one decimal)."""
    return round(rate / 1e6, 1)


def format_eta(eta_s: float | None) -> str:
    """``1:05`` for 65 s, ``1:01:05`` past an hour, ``-:--`` while unknown."""
    if eta_s is None or not math.isfinite(eta_s):
        return "-:--"
    s = max(0, math.ceil(eta_s))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02}:{s:02}" if h else f"{m}:{s:02}"


class TerminalBar:
    """One rich progress bar on stderr; every method is a no-op when stderr is no terminal.

    While it is shown, log lines written to stderr go through rich's console, so they are
    printed above the bar instead of through it.
    """

    def __init__(self, description: str, total: int, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.description, self.total = description, total
        self._progress: Any = None
        self._task: Any = None
        self._streams: list[tuple[logging.StreamHandler[Any], Any]] = []

    def __enter__(self) -> TerminalBar:
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        # two downloads at once (an enrollment and a hot expert) nest: both bars are shown
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TextColumn("{task.fields[speed]}"),
            TextColumn("eta {task.fields[eta]}"),
            console=Console(stderr=True),
            transient=False,
            redirect_stderr=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            self.description, total=self.total, speed="-- MB/s", eta=format_eta(None)
        )
        self._route_logs(sys.stderr)
        return self

    def show(self, meter: Meter, description: str | None = None) -> None:
        if self._progress is None:
            return
        self._progress.update(
            self._task,
            completed=meter.done,
            total=meter.total,
            speed=f"{mb_s(meter.rate):.1f} MB/s",
            eta=format_eta(meter.eta_s),
            **({"description": description} if description else {}),
        )

    def __exit__(self, *exc: object) -> None:
        if self._progress is None:
            return
        self._progress.stop()
        for handler, stream in self._streams:
            handler.setStream(stream)
        self._streams.clear()
        self._progress = None

    def _route_logs(self, proxy: Any) -> None:
        """Point the stderr log handlers at rich's stderr proxy while the bar is live."""
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stderr__:
                self._streams.append((handler, handler.setStream(proxy)))
