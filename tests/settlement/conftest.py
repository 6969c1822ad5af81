"""Settlement fixtures: a real local chain on 127.0.0.1, real solana-py clients, real SQLite."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pyotp
import pytest
import trio
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

from kvasird.settlement.admin import AdminAuth
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.claims import Payouts
from kvasird.settlement.config import RevenueSplit, TierThresholds
from kvasird.settlement.governance import Governance
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo, serve_local_chain
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.payments import Payments
from kvasird.settlement.pricing import NetworkParams, PriceController
from kvasird.settlement.rewards import MeasuredWork, Rewards
from kvasird.settlement.token import transfer_instructions

KVR = 10**6
"""One KVR in base units."""


@pytest.fixture
async def local_chain(nursery: trio.Nursery, tmp_path: Path) -> LocalChainInfo:
    with trio.fail_after(10):
        return await nursery.start(serve_local_chain, tmp_path / "chain")


@pytest.fixture
async def chain(local_chain: LocalChainInfo) -> AsyncIterator[ChainClient]:
    client = ChainClient(local_chain.url, poll_interval_s=0.005)
    yield client
    await client.aclose()


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "state.db")


async def funded(chain: ChainClient, info: LocalChainInfo, kvr: int = 0) -> Keypair:
    """A fresh wallet with SOL for fees and ``kvr`` base units of KVR."""
    wallet = Keypair()
    with trio.fail_after(10):
        await chain.faucet(wallet.pubkey(), kvr=kvr, lamports=10**9)
    return wallet


async def pay(
    chain: ChainClient,
    sender: Keypair,
    recipient: Keypair | object,
    mint: object,
    amount: int,
    memo: bytes | None = None,
) -> Signature:
    """Send KVR on chain and wait until it is final."""
    to = recipient.pubkey() if isinstance(recipient, Keypair) else recipient
    with trio.fail_after(10):
        return await chain.send_and_confirm(
            [sender], transfer_instructions(sender.pubkey(), to, mint, amount, memo)
        )  # type: ignore[arg-type]


@dataclass
class Gateway:
    """A gateway's settlement parts on the local chain."""

    wallet: Keypair
    """Vault owner and payout signer."""
    payments: Payments
    """Quote and payment verification."""
    locks: KeyedLocks
    """Shared per-key locks."""


@pytest.fixture
async def gateway(chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> Gateway:
    wallet = await funded(chain, local_chain)
    locks = KeyedLocks()
    payments = Payments(
        ledger,
        chain,
        vault=wallet.pubkey(),
        mint=local_chain.mint,
        prices=PriceController(),
        locks=locks,
    )
    return Gateway(wallet, payments, locks)


NETWORK = "kvasir-test"
PEER = "12D3KooWPeerOne"
ONE_KVR_PER_1K = NetworkParams(
    version=0, floor=KVR, ceiling=KVR, target_utilization=0.5, gain=0.5, smoothing=0.5
)


@dataclass
class Economy:
    """A gateway that takes payments, splits them, and pays out, on the local chain."""

    vault: Keypair
    """Gateway wallet."""
    payments: Payments
    """Quotes and verification."""
    rewards: Rewards
    """Split and receipts."""
    payouts: Payouts
    """Claims and refunds."""
    consumer: Keypair
    """A funded consumer wallet."""

    async def paid_request(self, chain: ChainClient, mint: Pubkey, kvr: int) -> str:
        quote = self.payments.quote(max_tokens=kvr * 1000)
        sig = await pay(
            chain, self.consumer, self.vault, mint, quote.amount, quote.reference.encode()
        )
        await self.payments.settle_quote(quote.request_id, sig)
        return quote.request_id


def make_payouts(
    ledger: Ledger, chain: ChainClient, vault: Keypair, mint: Pubkey, locks: KeyedLocks
) -> Payouts:
    return Payouts(ledger, chain, vault, mint, locks, confirm_timeout_s=5)


@pytest.fixture
async def economy(chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger) -> Economy:
    vault = await funded(chain, local_chain)
    locks = KeyedLocks()
    return Economy(
        vault,
        Payments(
            ledger,
            chain,
            vault=vault.pubkey(),
            mint=local_chain.mint,
            prices=PriceController(ONE_KVR_PER_1K),
            locks=locks,
        ),
        Rewards(ledger, vault, NETWORK, RevenueSplit(), TierThresholds()),
        make_payouts(ledger, chain, vault, local_chain.mint, locks),
        await funded(chain, local_chain, 1000 * KVR),
    )


async def earn_100_kvr(economy: Economy, chain: ChainClient, mint: Pubkey) -> None:
    """One 125 KVR request served by PEER alone: 80% = 100 KVR earned."""
    request = await economy.paid_request(chain, mint, 125)
    economy.rewards.settle(request, [MeasuredWork(PEER, units=1000, ms_per_token=100.0)], epoch=1)
    assert economy.payouts.claimable(PEER) == 100 * KVR


class Clock:
    """A settable clock (TOTP codes depend on time)."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def operator() -> Keypair:
    return Keypair()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def auth(ledger: Ledger, operator: Keypair, clock: Clock) -> tuple[AdminAuth, pyotp.TOTP]:
    admin = AdminAuth(ledger, operator.pubkey(), "node.example", clock=clock)
    secret = re.search(r"secret=([A-Z2-7]+)", admin.enroll_totp()).group(1)
    return admin, pyotp.TOTP(secret)


@pytest.fixture
def genesis() -> Keypair:
    return Keypair()


@pytest.fixture
def governance(ledger: Ledger, genesis: Keypair) -> Governance:
    return Governance(ledger, genesis.pubkey(), NETWORK)
