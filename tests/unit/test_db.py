"""state.db is checked when opened: a damaged or empty file is refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvasird.db import connect, ensure_schema
from kvasird.errors import HomeError


def _filled(path: Path) -> bytes:
    conn = connect(path)
    ensure_schema(conn, "CREATE TABLE IF NOT EXISTS t (k TEXT PRIMARY KEY, v TEXT);")
    with conn:
        conn.executemany("INSERT INTO t VALUES (?, ?)", [(f"k{i}", "v" * 200) for i in range(2000)])
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path.read_bytes()


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_a_cut_short_database_is_refused_naming_the_file(tmp_path: Path, fraction: float) -> None:
    data = _filled(tmp_path / "whole.db")
    cut = tmp_path / "state.db"
    cut.write_bytes(data[:int(len(data) * fraction)])
    with pytest.raises(HomeError, match="state.db is damaged") as caught:
        connect(cut)
    assert "\n" not in str(caught.value)
    assert "backup" in str(caught.value) and "move it aside" in str(caught.value)


def test_an_empty_database_is_refused_unless_created(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"")
    with pytest.raises(HomeError, match=r"state.db is damaged \(0 bytes\)"):
        connect(path)
    assert path.stat().st_size == 0  # refused without writing to it
    connect(path, create=True).close()
    connect(path).close()  # initialised: a database now


def test_a_file_that_is_no_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"not sqlite " * 500)
    with pytest.raises(HomeError, match="not a database"):
        connect(path)


def test_a_whole_database_and_a_missing_one_open(tmp_path: Path) -> None:
    _filled(tmp_path / "state.db")
    conn = connect(tmp_path / "state.db")
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (2000,)
    conn.close()
    connect(tmp_path / "new.db").close()
