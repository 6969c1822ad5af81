"""The assembled settlement service, as the daemon starts it, on its embedded local chain."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from solders.keypair import Keypair

from kvasird.config.schema import SettlementSection
from kvasird.home import Home
from kvasird.settlement.config import SettlementConfig
from kvasird.settlement.errors import GovernanceRejected, WalletError
from kvasird.settlement.governance import sign_governance
from kvasird.settlement.localchain.genesis import load_or_create_genesis
from kvasird.settlement.pricing import NetworkParams
from kvasird.settlement.rewards import MeasuredWork
from kvasird.settlement.service import Settlement, run_settlement
from kvasird.settlement.wallet import sign_link, write_keypair

from .conftest import KVR, funded, pay

NETWORK = "kvasir-test"


async def start(nursery: trio.Nursery, home: Path, config: SettlementConfig) -> Settlement:
    with trio.fail_after(20):
        return await nursery.start(run_settlement, config, Home(home), "12D3KooWMe", NETWORK)


async def test_gateway_quotes_verifies_settles_pays_claims_and_refunds(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    write_keypair(tmp_path / "wallet.json", Keypair())
    s = await start(nursery, tmp_path, SettlementConfig(SettlementSection(wallet="wallet.json")))
    assert s.local_chain is not None
    assert await s.chain.lamports(s.wallet.address) > 0  # local vault funded for fees
    consumer = await funded(s.chain, s.local_chain, 100 * KVR)
    before = await s.chain.token_balance(consumer.pubkey(), s.mint)
    served, failed = s.payments.quote(max_tokens=2000), s.payments.quote(max_tokens=1000)
    for quote in (served, failed):
        sig = await pay(
            s.chain, consumer, s.wallet.address, s.mint, quote.amount, quote.reference.encode()
        )
        await s.payments.settle_quote(quote.request_id, sig)
    rewards, _ = s.gateway()
    split = rewards.settle(served.request_id, [MeasuredWork("12D3KooWPeer", 10, 30.0)], epoch=7)

    peer_wallet = Keypair()
    link = sign_link(peer_wallet, "12D3KooWPeer", NETWORK).to_wire()
    payout = await s.claim("12D3KooWPeer", {"link": link})
    assert payout.amount == split.workers["12D3KooWPeer"] > 0
    assert await s.chain.token_balance(peer_wallet.pubkey(), s.mint) == payout.amount

    refund = await s.refund_failed(failed.request_id)
    assert refund.amount == failed.amount
    assert await s.chain.token_balance(consumer.pubkey(), s.mint) == before - served.amount


async def test_governance_from_the_genesis_wallet_retunes_the_price(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    s = await start(nursery, tmp_path,
                    SettlementConfig(SettlementSection(wallet_address=str(Keypair().pubkey()))))
    genesis, _ = load_or_create_genesis(tmp_path / "localchain" / "genesis.json")
    band = NetworkParams(1, floor=50, ceiling=60, target_utilization=0.5, gain=1, smoothing=1)
    with pytest.raises(GovernanceRejected):
        s.apply_governance(sign_governance(Keypair(), NETWORK, band).to_wire())
    s.apply_governance(sign_governance(genesis.authority, NETWORK, band).to_wire())
    assert 50 <= s.prices.price <= 60
    with pytest.raises(WalletError, match="only the address"):
        s.gateway()
