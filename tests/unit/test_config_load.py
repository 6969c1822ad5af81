"""A kvasird.toml cut short is refused with one line, however it was cut."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvasird.config import default_text, load, load_text, render
from kvasird.config.load import END
from kvasird.daemon.init import init_home
from kvasird.errors import ConfigError
from kvasird.home import Home

PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWESNwYUkewwdrtKoRqtf8HD43B1fEcnjCzBuQyw2qh5av"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The kvasird.toml that `kvasird init` writes."""
    home = Home(tmp_path_factory.mktemp("home"))
    init_home(home, {"p2p.bootstrap": [PEER], "p2p.listen": ["/ip4/127.0.0.1/tcp/4001"]})
    return home.config.read_text()


def _refused(path: Path, text: str) -> str:
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    return message


def test_the_written_file_loads_whole(written: str, tmp_path: Path) -> None:
    (tmp_path / "kvasird.toml").write_text(written)
    config = load(tmp_path / "kvasird.toml")
    assert config.p2p.bootstrap == (PEER,)
    assert config.p2p.listen == ("/ip4/127.0.0.1/tcp/4001",)


def test_a_file_cut_before_p2p_is_refused_not_run_on_defaults(written: str,
                                                               tmp_path: Path) -> None:
    cut = written[:written.index("[p2p]")]
    load_text(cut.replace(cut.splitlines()[0], "# written by hand"))  # valid TOML: it parses
    message = _refused(tmp_path / "kvasird.toml", cut)
    assert "was cut short" in message and "backup" in message and END in message


def test_every_cut_at_a_line_end_is_refused(written: str, tmp_path: Path) -> None:
    ends = [i + 1 for i, c in enumerate(written[:-1]) if c == "\n"]
    for at in ends[:-2]:  # the whole file less its last line, or more
        assert "was cut short" in _refused(tmp_path / "kvasird.toml", written[:at])


def test_a_cut_mid_line_is_refused_with_its_line_number(written: str, tmp_path: Path) -> None:
    line = next(i for i, text in enumerate(written.splitlines()) if text.startswith("listen ="))
    at = written.index('listen = ["') + len('listen = ["/ip4/1')
    message = _refused(tmp_path / "kvasird.toml", written[:at])
    assert "was cut short" in message and f"line {line + 1}" in message


def test_cuts_anywhere_are_refused(written: str, tmp_path: Path) -> None:
    for at in range(1, len(written) - len(END) - 1, 53):
        _refused(tmp_path / "kvasird.toml", written[:at])


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    assert "empty" in _refused(tmp_path / "kvasird.toml", "")


def test_render_keeps_the_end_line_last(written: str) -> None:
    text = render(written, {"p2p.bootstrap": [], "p2p.max_peers": 9, "market.hold": ["head"]})
    assert text.rstrip().splitlines()[-1] == END
    assert load_text(text).p2p.max_peers == 9
    trimmed = written.replace("[settlement]", "[cut]").split("[cut]")[0] + END + "\n"
    text = render(trimmed, {"settlement.enabled": False, "settlement.max_unpaid": 5})
    assert text.rstrip().splitlines()[-1] == END
    assert load_text(text).settlement.max_unpaid == 5


def test_a_file_without_the_header_is_only_parsed() -> None:
    older = default_text().replace(END, "").split("\n", 1)[1]
    cut = older[:older.index("[p2p]")]
    assert load_text(cut).node.network == "kvasir-local"
    with pytest.raises(ConfigError, match=r"is not valid TOML .*line 3"):
        load_text('[node]\nnetwork = "x"\nlog_level = "inf')
