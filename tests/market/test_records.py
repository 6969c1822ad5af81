from __future__ import annotations

import pytest

from kvasird.errors import WireError
from kvasird.market.records import CoverageRecord, Holding, LoadReport, compress
from kvasird.model.manifest import HEAD, Unit

MODEL = "ab" * 32


def record(**over: object) -> dict:
    base = CoverageRecord(peer="12D3KooWpeer", seq=5, ts=1000.0, ttl=15.0, state="online",
                          protocol=1, version="0.1.0", addrs=("/ip4/127.0.0.1/tcp/1/p2p/x",),
                          model=MODEL, budget=10_000,
                          holdings=(Holding("L", 0, 0, 2, "online"),)).to_wire()
    base.update(over)
    return base


def test_round_trip() -> None:
    r = CoverageRecord.from_wire(record())
    assert CoverageRecord.from_wire(r.to_wire()) == r
    assert r.units() == {Unit("layer", 0): "online", Unit("layer", 1): "online"}


def test_the_boot_id_travels_and_older_records_without_one_still_parse() -> None:
    r = CoverageRecord.from_wire(record(boot="0123abcd0123abcd"))
    assert r.boot == "0123abcd0123abcd" and r.to_wire()["boot"] == r.boot
    assert "boot" not in CoverageRecord.from_wire(record()).to_wire()


def test_the_model_name_travels_and_older_records_without_one_still_parse() -> None:
    r = CoverageRecord.from_wire(record(name="smollm2:135m-instruct", adopted=True))
    assert (r.name, r.adopted) == ("smollm2:135m-instruct", True)
    assert CoverageRecord.from_wire(r.to_wire()) == r
    older = CoverageRecord.from_wire(record())
    assert (older.name, older.adopted) == ("", False)
    assert "name" not in older.to_wire() and "adopted" not in older.to_wire()


def test_a_chosen_name_is_not_marked_adopted_on_the_wire() -> None:
    wire = CoverageRecord.from_wire(record(name="tiny:q3")).to_wire()
    assert wire["name"] == "tiny:q3" and "adopted" not in wire


@pytest.mark.parametrize(("change", "fragment"), [
    ({"v": 2}, "schema version"),
    ({"seq": -1}, "coverage.seq"),
    ({"seq": "5"}, "coverage.seq"),
    ({"state": "asleep"}, "coverage.state"),
    ({"model": "xyz"}, "hex sha256"),
    ({"holdings": [["L", 3, 1, "online"]]}, "bad layer range"),
    ({"holdings": [["E", 0, 0, 10**9, "online"]]}, "bad range"),
    ({"holdings": [["L", 0, 1, "sleeping"]]}, "state must be"),
    ({"holdings": [["Q"]]}, "holding"),
    ({"holdings": [["L", 0, 1, "online"]] * 5000}, "at most 4096"),
    ({"addrs": ["x" * 300]}, "coverage.addrs"),
    ({"boot": "b" * 33}, "coverage.boot"),
    ({"boot": 7}, "coverage.boot"),
    ({"caps": {"backend": "CPU", "precision": "f32", "verdict": "maybe", "threads": 1}}, "verdict"),
    ({"model": "", "holdings": [["H", "online"]]}, "without a model id"),
    ({"name": "SmolLM2 135M Instruct"}, "coverage.name: a model name is"),
    ({"name": "x" * 200}, "coverage.name"),
    ({"name": 7}, "coverage.name"),
    ({"model": "", "holdings": [], "name": "tiny:q3"}, "name given without a model id"),
    ({"adopted": True}, "adopted given without a name"),
    ({"name": "tiny:q3", "adopted": 1}, "coverage.adopted"),
])
def test_malformed_records_are_refused_naming_the_field(change: dict, fragment: str) -> None:
    with pytest.raises(WireError, match=fragment):
        CoverageRecord.from_wire(record(**change))


def test_not_a_map_is_refused() -> None:
    with pytest.raises(WireError):
        CoverageRecord.from_wire([1, 2, 3])


def test_compress_merges_consecutive_units_in_the_same_state() -> None:
    units = {HEAD: "online", Unit("layer", 0): "online", Unit("layer", 1): "online",
             Unit("layer", 3): "online", Unit("expert", 2, 0): "joining",
             Unit("expert", 2, 1): "joining", Unit("expert", 2, 2): "online"}
    out = compress(units)
    assert [h.to_wire() for h in out] == [
        ["E", 2, 0, 2, "joining"], ["E", 2, 2, 3, "online"], ["H", "online"],
        ["L", 0, 2, "online"], ["L", 3, 4, "online"]]
    assert {u: h.state for h in out for u in h.units()} == units


def test_load_report_validation() -> None:
    ok = LoadReport("p", 1, 1.0, MODEL, 60.0, 100, ((0, 1, 5),))
    assert LoadReport.from_wire(ok.to_wire()) == ok
    bad = ok.to_wire() | {"experts": [[0, -1, 5]]}
    with pytest.raises(WireError, match="load.experts"):
        LoadReport.from_wire(bad)
