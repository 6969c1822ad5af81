"""Network parameters move only by genesis-signed, newer, same-network messages; price in band."""

from __future__ import annotations

import pytest
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from kvasird.settlement.errors import GovernanceRejected
from kvasird.settlement.governance import Governance, GovernanceMessage, sign_governance
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.pricing import GENESIS_PARAMS, NetworkParams, PriceController

from .conftest import NETWORK


def params(version: int, floor: int = 100, ceiling: int = 1000) -> NetworkParams:
    return NetworkParams(version, floor, ceiling, target_utilization=0.6, gain=0.4, smoothing=0.5)


def test_genesis_signed_message_changes_the_parameters(
    governance: Governance, genesis: Keypair
) -> None:
    assert governance.params() == GENESIS_PARAMS
    wire = sign_governance(genesis, NETWORK, params(1)).to_wire()
    assert governance.apply(GovernanceMessage.from_wire(wire)) == params(1)
    assert governance.params() == params(1)


def test_message_not_signed_by_genesis_wallet_changes_nothing(governance: Governance) -> None:
    with pytest.raises(GovernanceRejected, match="not signed by the genesis wallet"):
        governance.apply(sign_governance(Keypair(), NETWORK, params(1)))
    assert governance.params() == GENESIS_PARAMS


def test_tampered_parameters_invalidate_the_signature(
    governance: Governance, genesis: Keypair
) -> None:
    wire = sign_governance(genesis, NETWORK, params(1)).to_wire()
    wire["params"]["floor"] = 1
    with pytest.raises(GovernanceRejected, match="not signed"):
        governance.apply(GovernanceMessage.from_wire(wire))
    assert governance.params() == GENESIS_PARAMS


def test_replayed_old_version_changes_nothing(governance: Governance, genesis: Keypair) -> None:
    old = sign_governance(genesis, NETWORK, params(1, floor=100))
    governance.apply(old)
    governance.apply(sign_governance(genesis, NETWORK, params(2, floor=300)))
    for stale in (old, sign_governance(genesis, NETWORK, params(2, floor=1))):
        with pytest.raises(GovernanceRejected, match="not newer"):
            governance.apply(stale)
    assert governance.params() == params(2, floor=300)


def test_message_for_another_network_changes_nothing(
    governance: Governance, genesis: Keypair
) -> None:
    with pytest.raises(GovernanceRejected, match="network"):
        governance.apply(sign_governance(genesis, "kvasir-other", params(1)))
    assert governance.params() == GENESIS_PARAMS


def test_applied_parameters_survive_a_restart(ledger: Ledger, genesis: Keypair, tmp_path) -> None:
    Governance(ledger, genesis.pubkey(), NETWORK).apply(
        sign_governance(genesis, NETWORK, params(3))
    )
    ledger.close()
    assert Governance(Ledger(tmp_path / "state.db"), genesis.pubkey(), NETWORK).params() == params(
        3
    )


def test_invalid_band_is_refused_even_when_signed() -> None:
    with pytest.raises(GovernanceRejected, match="floor"):
        params(1, floor=500, ceiling=100)


def test_idle_supply_lowers_price_to_the_floor_and_congestion_raises_it_to_the_ceiling() -> None:
    prices = PriceController(params(1))
    start = prices.price
    idle = [prices.observe(0.05) for _ in range(200)]
    assert idle[0] < start and idle == sorted(idle, reverse=True) and idle[-1] == 100
    busy = [prices.observe(1.0) for _ in range(200)]
    assert busy[-1] == 1000 and all(100 <= p <= 1000 for p in busy)


def test_retune_keeps_the_price_inside_the_new_band() -> None:
    prices = PriceController(params(1), price=900)
    prices.retune(params(2, floor=100, ceiling=500))
    assert prices.price == 500
    assert prices.amount_for(1500) == 750


def test_config_has_no_path_into_network_parameters() -> None:
    from dataclasses import fields

    from kvasird.config.schema import SettlementSection
    from kvasird.settlement.config import SettlementConfig

    names = {f.name for f in (*fields(SettlementConfig), *fields(SettlementSection))}
    assert not names & {"floor", "ceiling", "gain", "smoothing", "target_utilization", "price"}
    assert isinstance(Pubkey.default(), Pubkey)


def test_signature_survives_the_wire_whatever_number_types_the_signer_used(
    governance: Governance, genesis: Keypair
) -> None:
    band = NetworkParams(1, floor=100, ceiling=200, target_utilization=0.5, gain=1, smoothing=1)
    wire = sign_governance(genesis, NETWORK, band).to_wire()
    assert governance.apply(GovernanceMessage.from_wire(wire)).gain == 1.0
