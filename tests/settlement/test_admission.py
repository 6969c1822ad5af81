"""No work without pay: a serving peer's rule for whom it works, against the real local chain."""

from __future__ import annotations

from dataclasses import replace

import pytest
from solders.keypair import Keypair
from solders.signature import Signature

from kvasird.settlement.admission import Admission, NotAdmitted
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
PARAMS = replace(GENESIS_PARAMS, stake_min=STAKE)


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
                     max_unpaid=limits.get("max_unpaid", 50 * KVR),
                     max_unreceipted=limits.get("max_unreceipted", 16), cache_s=30,
                     clock=clock or Clock())


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


async def test_a_gateway_that_sends_no_receipts_is_cut_off(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> None:
    operator = await funded(chain, local_chain, kvr=STAKE)
    links = {GATEWAY_PEER: sign_link(operator, GATEWAY_PEER, NETWORK)}
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links,
                     max_unreceipted=3)
    for _ in range(3):
        await rule.check(GATEWAY_PEER)
        rule.opened(GATEWAY_PEER)
    with pytest.raises(NotAdmitted, match="opened 3 sessions here without sending a receipt"):
        await rule.check(GATEWAY_PEER)
    rule.receipted(GATEWAY_PEER)
    await rule.check(GATEWAY_PEER)
    assert rule.refused[GATEWAY_PEER] == 1


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
    rule = admission(chain, local_chain, ReceiptBook(ledger, PEER, NETWORK), links, clock,
                     max_unreceipted=1)
    await rule.check(GATEWAY_PEER)
    rule.opened(GATEWAY_PEER)  # now refused by a full check
    with pytest.raises(NotAdmitted, match="without sending a receipt"):
        await rule.check(GATEWAY_PEER)
    with pytest.raises(NotAdmitted):  # a refusal clears the pass: no stale "yes" after a "no"
        await rule.check(GATEWAY_PEER, fresh_s=1.0)
    rule.receipted(GATEWAY_PEER)
    await rule.check(GATEWAY_PEER)
    rule.opened(GATEWAY_PEER)
    clock.now += 0.5
    await rule.check(GATEWAY_PEER, fresh_s=1.0)  # the pass of 0.5 s ago stands
    clock.now += 0.6
    with pytest.raises(NotAdmitted, match="without sending a receipt"):
        await rule.check(GATEWAY_PEER, fresh_s=1.0)
