"""Quotes are honoured until they expire, stale open ones are swept, clients are rate-limited."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from solders.signature import Signature

from kvasird.config import GatewayConfig
from kvasird.gateway import Gateway
from kvasird.gateway.app import build_app
from kvasird.gateway.payment import Settling
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import QuoteError, QuotesTooFrequent
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.payments import (
    QUOTE_BURST,
    QUOTE_GRACE_S,
    QUOTE_SWEEP_BATCH,
    Payments,
    QuoteLimiter,
)
from kvasird.settlement.pricing import PriceController

from .conftest import KVR, Clock, funded, pay

TTL_S = 60.0
CLIENT = "198.51.100.7"


@pytest.fixture
async def payments(
    chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger, clock: Clock
) -> Payments:
    vault = await funded(chain, local_chain)
    return Payments(
        ledger,
        chain,
        vault=vault.pubkey(),
        mint=local_chain.mint,
        prices=PriceController(),
        locks=KeyedLocks(),
        quote_ttl_s=TTL_S,
        clock=clock,
    )


def open_quotes(ledger: Ledger) -> int:
    return ledger.value("SELECT COUNT(*) FROM settlement_quotes WHERE state = 'open'")


async def test_quote_is_not_honoured_after_its_expiry(payments: Payments, clock: Clock) -> None:
    quote = payments.quote(100)
    clock.now = quote.expires_at + 1
    with pytest.raises(QuoteError, match="expired: ask for a new quote"):
        await payments.settle_quote(quote.request_id, Signature.new_unique())


async def test_just_expired_quote_says_expired_not_unknown(
    payments: Payments, clock: Clock
) -> None:
    quote = payments.quote(100)
    clock.now = quote.expires_at + QUOTE_GRACE_S - 1
    payments.quote(100)
    with pytest.raises(QuoteError, match="expired"):
        await payments.settle_quote(quote.request_id, Signature.new_unique())


async def test_open_quotes_past_the_grace_are_deleted(
    payments: Payments, ledger: Ledger, clock: Clock
) -> None:
    stale = payments.quote(100)
    clock.now = stale.expires_at + QUOTE_GRACE_S + 1
    payments.quote(100)
    assert payments.quoted_tokens(stale.request_id) == 0
    assert open_quotes(ledger) == 1
    with pytest.raises(QuoteError, match="unknown request id"):
        await payments.settle_quote(stale.request_id, Signature.new_unique())


async def test_paid_quotes_are_never_deleted(
    chain: ChainClient, local_chain: LocalChainInfo, payments: Payments, clock: Clock
) -> None:
    consumer = await funded(chain, local_chain, 10 * KVR)
    quote = payments.quote(1000)
    sig = await pay(
        chain, consumer, payments.vault, local_chain.mint, quote.amount, quote.reference.encode()
    )
    proof = await payments.settle_quote(quote.request_id, sig)
    clock.now = quote.expires_at + 100 * QUOTE_GRACE_S
    payments.quote(100)
    assert payments.quoted_tokens(quote.request_id) == 1000
    assert await payments.settle_quote(quote.request_id, sig) == proof


async def test_each_quote_sweeps_a_bounded_number_of_stale_quotes(
    payments: Payments, ledger: Ledger, clock: Clock
) -> None:
    backlog = QUOTE_SWEEP_BATCH + 5
    for _ in range(backlog):
        payments.quote(100)
    clock.now += TTL_S + QUOTE_GRACE_S + 1
    payments.quote(100)
    assert open_quotes(ledger) == backlog + 1 - QUOTE_SWEEP_BATCH
    payments.quote(100)
    assert open_quotes(ledger) == 2


async def test_a_client_past_its_burst_must_wait(payments: Payments, clock: Clock) -> None:
    for _ in range(QUOTE_BURST):
        payments.quote(100, CLIENT)
    with pytest.raises(QuotesTooFrequent, match=f"too many quotes from {CLIENT}: wait 1 s"):
        payments.quote(100, CLIENT)
    payments.quote(100, "198.51.100.8")
    clock.now += 1
    payments.quote(100, CLIENT)
    with pytest.raises(QuotesTooFrequent):
        payments.quote(100, CLIENT)


async def test_in_process_callers_are_not_rate_limited(payments: Payments) -> None:
    for _ in range(QUOTE_BURST + 5):
        payments.quote(100)


def test_limiter_tracks_a_bounded_number_of_clients(clock: Clock) -> None:
    limiter = QuoteLimiter(clock, max_clients=3)
    for i in range(10):
        limiter.take(f"203.0.113.{i}")
    assert limiter.tracked == 3


def test_limiter_says_how_long_to_wait(clock: Clock) -> None:
    limiter = QuoteLimiter(clock, burst=2, refill_per_s=0.25)
    limiter.take(CLIENT)
    limiter.take(CLIENT)
    with pytest.raises(QuotesTooFrequent, match="wait 4 s") as refused:
        limiter.take(CLIENT)
    assert refused.value.wait_s == 4


@dataclass(frozen=True)
class SettlementWithPayments:
    """The part of Settlement the quote route uses."""

    payments: Payments


async def test_gateway_answers_429_to_a_client_asking_too_often(payments: Payments) -> None:
    settled = SettlementWithPayments(payments)
    settling = Settling(lambda: settled,  # type: ignore[arg-type,return-value]
                        exchange=lambda: None, me="12D3KooWGateway", layers=lambda: 1)
    gateway = Gateway(GatewayConfig(), settling=settling)
    transport = httpx.ASGITransport(app=build_app(gateway), client=("203.0.113.9", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        answers = [
            (await http.post("/v1/kvasir/quote", json={"max_tokens": 10})).status_code
            for _ in range(QUOTE_BURST + 1)
        ]
        refused = await http.post("/v1/kvasir/quote", json={"max_tokens": 10})
    assert answers == [200] * QUOTE_BURST + [429]
    assert refused.status_code == 429
    assert "too many quotes from 203.0.113.9: wait" in refused.json()["error"]["message"]
