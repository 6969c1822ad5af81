"""Rewards follow the gateway's measurements; receipts are signed, cumulative, checked by peers."""

from __future__ import annotations

import pytest
from solders.keypair import Keypair

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.config import RevenueSplit, TierThresholds
from kvasird.settlement.errors import (
    QuoteError,
    ReceiptRejected,
)
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo
from kvasird.settlement.receipts import Receipt, ReceiptBook, receipt_body
from kvasird.settlement.rewards import MeasuredWork, split_revenue, tier_for

from .conftest import KVR, NETWORK, PEER, Economy, earn_100_kvr

TIERS = TierThresholds(s_ms=25, a_ms=60, b_ms=150)


def test_tier_comes_from_measured_latency() -> None:
    assert [tier_for(ms, TIERS) for ms in (10, 25, 40, 150, 151)] == ["S", "S", "A", "B", "C"]


def test_split_weights_measured_units_by_tier_and_accounts_for_every_unit() -> None:
    work = [
        MeasuredWork("fast", MeasuredWork.stage_units(tokens=100, layers=10), ms_per_token=10),
        MeasuredWork("slow", MeasuredWork.worker_units(rows=100, experts=10), ms_per_token=500),
    ]
    result = split_revenue(1_000_003, work, RevenueSplit(), TIERS)
    assert result.workers["fast"] * 70 == pytest.approx(result.workers["slow"] * 150, rel=1e-5)
    assert result.insurance == 1_000_003 * 500 // 10_000
    assert sum(result.workers.values()) + result.operator + result.insurance == 1_000_003


def test_split_without_work_goes_to_operator_and_insurance() -> None:
    result = split_revenue(1000, [], RevenueSplit(), TIERS)
    assert (result.workers, result.operator, result.insurance) == ({}, 950, 50)


async def test_request_is_settled_once(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy
) -> None:
    request = await economy.paid_request(chain, local_chain.mint, 5)
    economy.rewards.settle(request, [MeasuredWork(PEER, 10, 20.0)], epoch=1)
    with pytest.raises(QuoteError):
        economy.rewards.settle(request, [MeasuredWork(PEER, 10, 20.0)], epoch=1)
    assert economy.rewards.earned(PEER) == 4 * KVR


async def test_each_peer_account_shows_what_it_earned_and_the_work_measured(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy
) -> None:
    request = await economy.paid_request(chain, local_chain.mint, 5)
    economy.rewards.settle(request, [MeasuredWork(PEER, 10, 20.0)], epoch=1)
    assert [p.to_json() for p in economy.rewards.peers()] == [
        {"peer_id": PEER, "earned": 4 * KVR, "paid": 0, "measured_units": 10}]


async def test_unpaid_request_earns_nothing(economy: Economy) -> None:
    quote = economy.payments.quote(1000)
    with pytest.raises(QuoteError):
        economy.rewards.settle(quote.request_id, [MeasuredWork(PEER, 10**9, 1.0)], epoch=1)
    assert economy.rewards.earned(PEER) == 0


async def test_peer_accepts_gateway_receipts_and_rejects_forged_or_stale_ones(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy, ledger: Ledger
) -> None:
    await earn_100_kvr(economy, chain, local_chain.mint)
    book = ReceiptBook(ledger, PEER, NETWORK)
    first = economy.rewards.receipt(PEER, epoch=1)
    assert book.accept(first.to_wire()).amount == 100 * KVR

    forger = Keypair()
    forged = first.to_wire() | {"amount": 10**12}
    with pytest.raises(ReceiptRejected, match="not signed"):
        book.accept(forged)
    self_signed = Receipt(
        NETWORK,
        forger.pubkey(),
        PEER,
        1,
        1,
        10**12,
        9,
        forger.sign_message(receipt_body(NETWORK, forger.pubkey(), PEER, 1, 1, 10**12, 9)),
    )
    book.accept(self_signed.to_wire())  # a valid receipt, but from a "gateway" nobody serves for
    assert book.unpaid(economy.vault.pubkey()) == 100 * KVR
    with pytest.raises(ReceiptRejected, match="not newer"):
        book.accept(first.to_wire())


def test_a_share_below_one_base_unit_per_request_is_paid_over_requests() -> None:
    """A spot check's replay beside a long route: a few percent of a request of 35 base
    units, under one unit each time; floored per request it was nothing, for good."""
    work = [MeasuredWork("route", MeasuredWork.stage_units(44, 31), ms_per_token=10),
            MeasuredWork("checker", MeasuredWork.stage_units(4, 13), ms_per_token=100)]
    carried: dict[str, int] = {}
    paid = {"route": 0, "checker": 0}
    operator = 0
    for _ in range(20):
        result = split_revenue(35, work, RevenueSplit(), TIERS, carried)
        carried = result.carried
        operator += result.operator
        paid = {p: paid[p] + result.workers[p] for p in paid}
        assert sum(result.workers.values()) + result.operator + result.insurance == 35
    pool = 20 * (35 * RevenueSplit().workers_bps // 10_000)
    weight = 52 * 100 / (52 * 100 + 44 * 31 * 150)
    assert paid["checker"] == int(pool * weight) > 0
    assert paid["route"] + paid["checker"] == pool - 1  # the carries hold less than a unit each
