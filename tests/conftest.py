"""Shared fixtures. Subsystem fixtures live in their own conftest files."""

from __future__ import annotations

import os

# ggml asserts abort the process; never let them also dump a backtrace via gdb.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")
# Parallel workers start networks side by side: each takes its own share of the ports.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("KVASIR_PORT_SHARE", "{}/{}".format(
        os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"),
        os.environ["PYTEST_XDIST_WORKER_COUNT"]))

import contextlib  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


@contextlib.contextmanager
def _held_by_another_thread(lock: Any) -> Iterator[None]:
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a long computation elsewhere, holding `lock` until released
        with lock:
            held.set()
            release.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    try:
        yield
    finally:
        release.set()
        thread.join()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default): a worker per core, at most 4 (a worker may run a network
    of several daemons); ``-n 0`` runs everything in one process."""
    return max(1, min(os.cpu_count() or 1, 4))


@pytest.fixture
def held_elsewhere() -> Callable[[Any], contextlib.AbstractContextManager[None]]:
    """`with held_elsewhere(lock):` runs its body while another thread holds `lock`."""
    return _held_by_another_thread


@pytest.fixture(scope="module")
def module_tmp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Callable[[str], Path]]:
    """``module_tmp(name)``: a new folder for a module's shared network, removed when the
    module ends with none of its tests failed, as pytest removes a passed test's own
    ``tmp_path`` (``tmp_path_retention_policy``). Every node's home holds its own copy of
    the model's pieces (~95 MB for the bundled one), and a run that kept them all took
    23 GB; a failed module's folders stay for reading."""
    made: list[Path] = []
    failed = request.session.testsfailed

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
