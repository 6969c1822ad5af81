"""No work without pay: a serving peer's rule for whom it works and its meter of the work,
against the real local chain."""

from __future__ import annotations

from dataclasses import replace

import pytest
from solders.keypair import Keypair
from solders.signature import Signature

from kvasird.settlement.admission import Admission, NotAdmitted, Rates
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import PaymentRejected, SignatureAlreadyUsed
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo
from kvasird.settlement.pricing import GENESIS_PARAMS, NetworkParams
from kvasird.settlement.receipts import ReceiptBook
from kvasird.settlement.wallet import WalletLink, sign_link

from .conftest import KVR, NETWORK, PEER, Economy, earn_100_kvr, funded

GATEWAY_PEER = "12D3KooWGateway"
STAKE = 1000 * KVR
CREDIT = 1000
PARAMS = replace(GENESIS_PARAMS, stake_min=STAKE, credit_units=CREDIT)
RATES = Rates(units_per_token=10, price=2000, floor=200)
"""A unit is worth 0.2 base units at this price; a base unit of a receipt covers 200 units."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def admission(chain: ChainClient, local_chain: LocalChainInfo, book: ReceiptBook,
              links: dict[str, WalletLink], clock: Clock | None = None,
              params: NetworkParams = PARAMS, **limits: int) -> Admission:
    async def balance(wallet):  # noqa: ANN001, ANN202 - the chain's answer, as the daemon reads it
        return await chain.token_balance(wallet, local_chain.mint)

    return Admission(PEER, NETWORK, links.get, book, balance, lambda: params,
                     max_unpaid=limits.get("max_unpaid", 50 * KVR), rates=lambda: RATES,
                     cache_s=30, clock=clock or Clock())


async def test_a_gateway_without_a_wallet_link_is_refused_with_what_to_do(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), {})
    with pytest.raises(NotAdmitted, match=r"announces no payout wallet.*\[settlement\] enabled"):
        await rule.check(GATEWAY_PEER)
    await rule.check(PEER)  # its own requests: always
    free = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), {},
                     params=replace(PARAMS, floor=0, ceiling=0))
    await free.check(GATEWAY_PEER)  # a network whose governance set the price to zero


async def test_a_gateway_below_the_stake_minimum_is_refused_until_it_holds_it(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    operator = await funded(chain, local_chain, kvr=STAKE - 1)
    links = {GATEWAY_PEER: sign_link(operator, GATEWAY_PEER, NETWORK)}
    clock = Clock()
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links, clock)
    with pytest.raises(NotAdmitted, match=r"holds 999\.999999 KVR, below .* 1000\.000000 KVR"):
        await rule.check(GATEWAY_PEER)
    await chain.faucet(operator.pubkey(), kvr=1)
    with pytest.raises(NotAdmitted, match="below"):  # the stake read is cached a while
        await rule.check(GATEWAY_PEER)
    clock.now += 31
    await rule.check(GATEWAY_PEER)


async def test_a_link_for_another_network_counts_as_none(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    operator = await funded(chain, local_chain, kvr=STAKE)
    links = {GATEWAY_PEER: sign_link(operator, GATEWAY_PEER, "another-network")}
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links)
    with pytest.raises(NotAdmitted, match="announces no payout wallet"):
        await rule.check(GATEWAY_PEER)


async def test_work_past_the_credit_is_refused_before_it_is_done_naming_the_gap(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    operator = await funded(chain, local_chain, kvr=STAKE)
    links = {GATEWAY_PEER: sign_link(operator, GATEWAY_PEER, NETWORK)}
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links)
    rule.charge(GATEWAY_PEER, 600)
    rule.charge(GATEWAY_PEER, CREDIT - 600)
    with pytest.raises(NotAdmitted, match=r"has 1000 units of work done here \(about "
                                          r"0\.000200 KVR\) that its receipts do not cover, "
                                          r"and its credit is 1000 units"):
        rule.charge(GATEWAY_PEER, 1)
    assert rule.accounts[operator.pubkey()].metered == CREDIT  # the refused work is not counted
    rule.charge(PEER, 10**9)  # its own work: never metered
    assert rule.refused[GATEWAY_PEER] == 1


async def test_a_receipt_counts_only_by_the_amount_it_adds(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    operator = await funded(chain, local_chain, kvr=STAKE)
    wallet = operator.pubkey()
    links = {GATEWAY_PEER: sign_link(operator, GATEWAY_PEER, NETWORK)}
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links)
    rule.charge(GATEWAY_PEER, CREDIT)
    assert rule.receipted(wallet, (0, 0), (CREDIT, 0)) == 0  # units without an amount
    with pytest.raises(NotAdmitted):
        rule.charge(GATEWAY_PEER, 1)
    assert rule.receipted(wallet, (CREDIT, 0), (CREDIT, 0)) == 0  # the same receipt again
    assert rule.receipted(wallet, (CREDIT, 0), (CREDIT, 2)) == 400  # 2 base units pay for 400
    rule.charge(GATEWAY_PEER, 400 + 20)  # and 5 % of what receipts covered is slack
    with pytest.raises(NotAdmitted):
        rule.charge(GATEWAY_PEER, 1)
    assert rule.receipted(wallet, (CREDIT, 2), (2 * CREDIT, 100)) == 2 * CREDIT - 400
    rule.charge(GATEWAY_PEER, CREDIT)


async def test_peer_ids_of_one_wallet_share_one_credit(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    operator = await funded(chain, local_chain, kvr=STAKE)
    second = "12D3KooWSecondGateway"
    links = {GATEWAY_PEER: sign_link(operator, GATEWAY_PEER, NETWORK),
             second: sign_link(operator, second, NETWORK)}
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links)
    await rule.check(second)
    rule.charge(GATEWAY_PEER, CREDIT)
    with pytest.raises(NotAdmitted, match=f"gateway wallet {operator.pubkey()} has 1000 units"):
        rule.charge(second, 1)


async def test_a_gateway_whose_receipts_lag_a_little_keeps_its_credit(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    """Its count and ours differ by failed steps and races: within the tolerance it keeps
    being served; a gateway that receipts a fifth short runs out; one honest for long that
    stops paying gets no more than twice the credit."""
    operator = await funded(chain, local_chain, kvr=STAKE)
    links = {GATEWAY_PEER: sign_link(operator, GATEWAY_PEER, NETWORK)}

    def run(rule: Admission, requests: int, receipted: int) -> None:
        done = (0, 0)
        for _ in range(requests):  # requests of 900 units, each receipted `receipted` units
            rule.charge(GATEWAY_PEER, 900)
            after = (done[0] + receipted, done[1] + 100)
            rule.receipted(operator.pubkey(), done, after)
            done = after

    def fresh() -> Admission:
        return admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links)

    honest = fresh()
    run(honest, 100, 891)  # 1 % short: 900 units in all
    honest.charge(GATEWAY_PEER, CREDIT)  # its credit is whole: the slack covered the gap
    with pytest.raises(NotAdmitted):
        run(fresh(), 100, 720)  # a fifth short
    stops = fresh()
    run(stops, 100, 900)
    stops.charge(GATEWAY_PEER, 2 * CREDIT)  # the credit and a capped slack
    with pytest.raises(NotAdmitted, match="its credit is 2000 units"):
        stops.charge(GATEWAY_PEER, 1)


async def test_peer_stops_serving_past_max_unpaid_until_paid(
        chain: ChainClient, local_chain: LocalChainInfo, economy: Economy,
        ledger: Ledger) -> None:
    await earn_100_kvr(economy, chain, local_chain.mint)
    await chain.faucet(economy.vault.pubkey(), kvr=STAKE)
    book = ReceiptBook(ledger, PEER, NETWORK)
    book.accept(economy.rewards.receipt(PEER, epoch=1).to_wire())
    gateway = economy.vault.pubkey()
    links = {GATEWAY_PEER: sign_link(economy.vault, GATEWAY_PEER, NETWORK)}
    rule = admission(chain, local_chain, book, links, max_unpaid=50 * KVR)
    with pytest.raises(NotAdmitted, match=r"owes this node 100\.000000 KVR in unpaid receipts"):
        await rule.check(GATEWAY_PEER)
    wallet = Keypair().pubkey()
    payout = await economy.payouts.claim(PEER, wallet)
    sig = Signature.from_string(payout.signature)
    with pytest.raises(PaymentRejected, match="not a payout"):
        await book.verify_payout(chain, Keypair().pubkey(), wallet, local_chain.mint, sig)
    assert await book.verify_payout(chain, gateway, wallet, local_chain.mint, sig) == 100 * KVR
    with pytest.raises(SignatureAlreadyUsed):
        await book.verify_payout(chain, gateway, wallet, local_chain.mint, sig)
    await rule.check(GATEWAY_PEER)


async def test_a_recent_pass_stands_only_for_as_long_as_asked(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    operator = await funded(chain, local_chain, kvr=STAKE)
    links = {GATEWAY_PEER: sign_link(operator, GATEWAY_PEER, NETWORK)}
    clock = Clock()
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links, clock)
    await rule.check(GATEWAY_PEER)
    links.pop(GATEWAY_PEER)  # its record is gone: a full check now refuses it
    with pytest.raises(NotAdmitted, match="announces no payout wallet"):
        await rule.check(GATEWAY_PEER)
    with pytest.raises(NotAdmitted):  # a refusal clears the pass: no stale "yes" after a "no"
        await rule.check(GATEWAY_PEER, fresh_s=1.0)
    links[GATEWAY_PEER] = sign_link(operator, GATEWAY_PEER, NETWORK)
    await rule.check(GATEWAY_PEER)
    links.pop(GATEWAY_PEER)
    clock.now += 0.5
    await rule.check(GATEWAY_PEER, fresh_s=1.0)  # the pass of 0.5 s ago stands
    clock.now += 0.6
    with pytest.raises(NotAdmitted, match="announces no payout wallet"):
        await rule.check(GATEWAY_PEER, fresh_s=1.0)
