"""Claims and refunds: pay first, then debit; concurrent claims pay once; crashes reconcile."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from solders.keypair import Keypair

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.claims import Payouts, parse_claim
from kvasird.settlement.errors import ClaimError
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.rewards import MeasuredWork
from kvasird.settlement.wallet import sign_link

from .conftest import KVR, NETWORK, PEER, Economy, earn_100_kvr, make_payouts, pay


async def test_three_concurrent_claims_against_one_balance_pay_exactly_once(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy
) -> None:
    await earn_100_kvr(economy, chain, local_chain.mint)
    wallet = Keypair().pubkey()
    outcomes: list[int | str] = []

    async def claim() -> None:
        try:
            outcomes.append((await economy.payouts.claim(PEER, wallet)).amount)
        except ClaimError:
            outcomes.append("refused")

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(claim)
    assert sorted(outcomes, key=str) == [100 * KVR, "refused", "refused"]
    assert await chain.token_balance(wallet, local_chain.mint) == 100 * KVR
    assert economy.payouts.claimable(PEER) == 0


async def test_crash_after_payout_sent_reconciles_without_double_pay(
    chain: ChainClient,
    local_chain: LocalChainInfo,
    economy: Economy,
    ledger: Ledger,
    tmp_path: Path,
) -> None:
    await earn_100_kvr(economy, chain, local_chain.mint)
    wallet = Keypair().pubkey()
    pending = await economy.payouts.prepare("claim", PEER, wallet, 100 * KVR, claimable(economy))
    await chain.send(economy.payouts.stored_transaction(pending.signature))
    ledger.close()  # the process dies here: paid on chain, not yet debited

    restarted = Ledger(tmp_path / "state.db")
    payouts = make_payouts(restarted, chain, economy.vault, local_chain.mint, KeyedLocks())
    assert payouts.claimable(PEER) == 0  # the pending payout reserves the amount
    ended = await payouts.reconcile()
    assert [(p.signature, p.state) for p in ended] == [(pending.signature, "done")]
    assert payouts.claimable(PEER) == 0
    assert await payouts.reconcile() == []
    with pytest.raises(ClaimError, match="nothing to claim"):
        await payouts.claim(PEER, wallet)
    assert await chain.token_balance(wallet, local_chain.mint) == 100 * KVR


async def test_crash_before_payout_sent_reconciles_by_sending_it_once(
    chain: ChainClient,
    local_chain: LocalChainInfo,
    economy: Economy,
    ledger: Ledger,
    tmp_path: Path,
) -> None:
    await earn_100_kvr(economy, chain, local_chain.mint)
    wallet = Keypair().pubkey()
    await economy.payouts.prepare("claim", PEER, wallet, 100 * KVR, claimable(economy))
    ledger.close()

    payouts = make_payouts(
        Ledger(tmp_path / "state.db"), chain, economy.vault, local_chain.mint, KeyedLocks()
    )
    assert [p.state for p in await payouts.reconcile()] == ["done"]
    assert await chain.token_balance(wallet, local_chain.mint) == 100 * KVR
    assert payouts.claimable(PEER) == 0


async def test_payout_whose_blockhash_expired_unsent_fails_and_balance_stays(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy
) -> None:
    await earn_100_kvr(economy, chain, local_chain.mint)
    wallet = Keypair().pubkey()
    await economy.payouts.prepare("claim", PEER, wallet, 100 * KVR, claimable(economy))
    filler = Keypair().pubkey()
    for _ in range(151):  # every landed transaction closes a slot; blockhashes live 150 slots
        await chain.request("requestAirdrop", [str(filler), 1])
    assert [p.state for p in await economy.payouts.reconcile()] == ["failed"]
    assert await chain.token_balance(wallet, local_chain.mint) == 0
    assert economy.payouts.claimable(PEER) == 100 * KVR
    assert (await economy.payouts.claim(PEER, wallet)).amount == 100 * KVR


async def test_self_asserted_units_roles_and_tiers_move_nothing(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy
) -> None:
    await earn_100_kvr(economy, chain, local_chain.mint)
    peer_wallet = Keypair()
    link = sign_link(peer_wallet, PEER, NETWORK).to_wire()
    for assertion in ({"units": 10**9}, {"tier": "S"}, {"role": "gateway"}, {"amount": 10**12}):
        with pytest.raises(ClaimError, match="measures work itself"):
            parse_claim({"link": link, **assertion}, PEER, NETWORK)
    assert economy.payouts.claimable(PEER) == 100 * KVR
    paid = await economy.payouts.claim(PEER, parse_claim({"link": link}, PEER, NETWORK))
    assert paid.amount == 100 * KVR
    assert await chain.token_balance(peer_wallet.pubkey(), local_chain.mint) == 100 * KVR


async def test_claim_with_another_peers_wallet_link_is_refused() -> None:
    link = sign_link(Keypair(), "12D3KooWSomeoneElse", NETWORK).to_wire()
    with pytest.raises(ClaimError, match="not 12D3KooWPeerOne"):
        parse_claim({"link": link}, PEER, NETWORK)


async def test_failed_inference_is_refunded_on_chain_from_the_insurance_pool(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy
) -> None:
    before = await chain.token_balance(economy.consumer.pubkey(), local_chain.mint)
    request = await economy.paid_request(chain, local_chain.mint, 10)
    economy.rewards.fail(request)
    refund = await economy.payouts.refund(request)
    assert (refund.state, refund.recipient, refund.amount) == (
        "done", str(economy.consumer.pubkey()), 10 * KVR)
    assert await chain.token_balance(economy.consumer.pubkey(), local_chain.mint) == before
    assert economy.rewards.pool("insurance") == 0
    with pytest.raises(ClaimError):
        await economy.payouts.refund(request)


async def test_payout_refused_by_the_chain_leaves_the_balance_intact(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy
) -> None:
    await earn_100_kvr(economy, chain, local_chain.mint)
    drained = await chain.token_balance(economy.vault.pubkey(), local_chain.mint)
    await pay(chain, economy.vault, Keypair(), local_chain.mint, drained)  # vault emptied
    wallet = Keypair().pubkey()
    with pytest.raises(ClaimError, match="balance unchanged"):
        await economy.payouts.claim(PEER, wallet)
    assert economy.payouts.claimable(PEER) == 100 * KVR
    assert await chain.token_balance(wallet, local_chain.mint) == 0


def claimable(economy: Economy) -> Callable[[sqlite3.Connection], int]:
    return lambda db: economy.payouts.claimable(PEER, db)


async def test_a_request_cut_short_is_refunded_its_unserved_part(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy
) -> None:
    before = await chain.token_balance(economy.consumer.pubkey(), local_chain.mint)
    request = await economy.paid_request(chain, local_chain.mint, 10)
    split = economy.rewards.settle(request, [MeasuredWork(PEER, 40, 10.0)], 1, served=4 * KVR)
    assert sum(split.workers.values()) + split.operator + split.insurance == 4 * KVR
    refund = await economy.payouts.refund(request)
    assert refund.amount == 6 * KVR
    assert await chain.token_balance(economy.consumer.pubkey(), local_chain.mint) == \
        before - 4 * KVR
    assert economy.rewards.pool("insurance") == split.insurance


async def test_two_processes_on_one_ledger_pay_a_claim_once(
    chain: ChainClient, local_chain: LocalChainInfo, economy: Economy, tmp_path: Path
) -> None:
    """Each has its own connection and its own locks (a second daemon on the same home):
    the claimable balance is read again where the pending payout is recorded."""
    await earn_100_kvr(economy, chain, local_chain.mint)
    other = make_payouts(Ledger(tmp_path / "state.db"), chain, economy.vault, local_chain.mint,
                         KeyedLocks())
    wallet = Keypair().pubkey()
    outcomes: list[object] = []

    async def claim(payouts: Payouts) -> None:
        try:
            outcomes.append(await payouts.claim(PEER, wallet))
        except ClaimError as exc:
            outcomes.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(claim, economy.payouts)
        nursery.start_soon(claim, other)
    assert sorted(type(o).__name__ for o in outcomes) == ["ClaimError", "Payout"]
    assert await chain.token_balance(wallet, local_chain.mint) == 100 * KVR
