"""The coverage record's optional reach field: old records parse, bad values do not."""

from __future__ import annotations

import pytest

from kvasird.errors import WireError
from kvasird.market.records import CoverageRecord

CIRCUIT = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWR/p2p-circuit/p2p/12D3KooWC"


def _record(reach: str) -> CoverageRecord:
    return CoverageRecord(peer="12D3KooWC", seq=1, ts=1.7e9, ttl=15.0, state="online",
                          protocol=1, version="0.1.0", addrs=(CIRCUIT,), model="", budget=0,
                          holdings=(), reach=reach)


def test_private_record_round_trips_with_its_circuit_address() -> None:
    back = CoverageRecord.from_wire(_record("private").to_wire())
    assert back.reach == "private" and back.addrs == (CIRCUIT,)


def test_record_from_an_older_node_without_reach_parses_as_unknown() -> None:
    wire = _record("public").to_wire()
    del wire["reach"]
    assert CoverageRecord.from_wire(wire).reach == "unknown"


def test_unknown_reach_value_is_refused() -> None:
    wire = {**_record("public").to_wire(), "reach": "sometimes"}
    with pytest.raises(WireError, match="coverage.reach"):
        CoverageRecord.from_wire(wire)
