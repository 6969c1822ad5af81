"""x402 at the gateway, on the assembled settlement service and its embedded local chain: the
requirements an unpaid request gets, read by the official x402 package, and the payments the
gateway verifies, co-signs and settles itself (or refuses, saying why, with nothing sent)."""

from __future__ import annotations

import base64
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from solders.keypair import Keypair
from solders.signature import Signature
from solders.transaction import VersionedTransaction
from x402 import x402ClientSync
from x402.http.utils import (
    decode_payment_required_header,
    decode_payment_response_header,
    encode_payment_signature_header,
)
from x402.schemas import PaymentPayload, PaymentRequired

from kvasird.config.schema import SettlementSection
from kvasird.gateway import errors, x402
from kvasird.home import Home
from kvasird.settlement.config import SettlementConfig
from kvasird.settlement.errors import PaymentRejected
from kvasird.settlement.payments import QUOTE_BURST
from kvasird.settlement.service import Settlement, run_settlement
from kvasird.settlement.token import KVR_DECIMALS
from kvasird.settlement.wallet import write_keypair
from kvasird.settlement.x402 import ExactSvmClient, ExactTerms, payment_transaction

KVR = 10**KVR_DECIMALS
SCOPE = {"type": "http", "scheme": "http", "path": "/v1/chat/completions",
         "headers": [(b"host", b"127.0.0.1:8080")], "client": ("127.0.0.1", 5000)}


@pytest.fixture
async def s(nursery: trio.Nursery, tmp_path: Path) -> Settlement:
    """A paid gateway's settlement: its wallet holds a keypair, its vault a token account."""
    write_keypair(tmp_path / "wallet.json", Keypair())
    config = SettlementConfig(SettlementSection(wallet="wallet.json"))
    with trio.fail_after(20):
        started: Settlement = await nursery.start(
            run_settlement, config, Home(tmp_path), "12D3KooWMe", "kvasir-test")
        await started.chain.faucet(started.wallet.address, kvr=1)
    return started


async def consumer(s: Settlement) -> Keypair:
    wallet = Keypair()
    with trio.fail_after(10):
        await s.chain.faucet(wallet.pubkey(), kvr=100 * KVR, lamports=10**9)
    return wallet


async def required(s: Settlement, prompt: int = 40, output: int = 16) -> PaymentRequired:
    """What a 402 for a request of ``prompt`` tokens in and ``output`` out carries, as the
    x402 package reads it."""
    err = await x402.offered(s, SCOPE, prompt, output, errors.PaymentRequired("pay first"))
    header = dict(err.headers)[x402.REQUIRED]
    parsed = decode_payment_required_header(header.decode())
    assert isinstance(parsed, PaymentRequired)
    return parsed


async def signed(s: Settlement, wallet: Keypair, offer: PaymentRequired) -> PaymentPayload:
    """The PAYMENT-SIGNATURE payload the x402 package's client makes (its scheme reads the
    chain synchronously: off this loop, which also serves the chain)."""
    client = x402ClientSync()
    client.register(offer.accepts[0].network, ExactSvmClient(wallet, s.chain.url))
    client.set_spend_controls({"allowed_assets": [
        {"network": offer.accepts[0].network, "asset": str(s.mint),
         "max_amount_per_payment": str(10 * KVR)}]})
    payload = await trio.to_thread.run_sync(client.create_payment_payload, offer)
    assert isinstance(payload, PaymentPayload)
    return payload


def header(payload: PaymentPayload) -> bytes:
    return encode_payment_signature_header(payload).encode()


async def test_an_unpaid_request_is_offered_its_quote_as_x402_requirements(s: Settlement) -> None:
    offer = await required(s, prompt=40, output=16)
    assert offer.x402_version == 2 and offer.error is not None and "pay first" in offer.error
    assert offer.resource is not None
    assert offer.resource.url == "http://127.0.0.1:8080/v1/chat/completions"
    [req] = offer.accepts
    genesis = await s.chain.genesis_hash()
    assert (req.scheme, req.network) == ("exact", f"solana:{genesis[:32]}")
    assert (req.asset, req.pay_to) == (str(s.mint), str(s.wallet.address))
    assert int(req.amount) == s.prices.amount_for(16, 40)  # priced as a quote of the request
    assert req.extra["feePayer"] == str(s.wallet.address)
    quote = s.payments.quote_of(req.extra["memo"])
    assert quote is not None and quote.amount == int(req.amount)
    assert req.max_timeout_seconds == int(s.config.section.quote_ttl_s)


async def test_a_payment_signed_with_the_x402_client_lands_once_and_pays_its_quote(
        s: Settlement) -> None:
    wallet = await consumer(s)
    offer = await required(s)
    payload = await signed(s, wallet, offer)
    amount = int(offer.accepts[0].amount)
    before = await s.chain.token_balance(wallet.pubkey(), s.mint)

    proof, settled = await x402.pay(s, header(payload))
    response = decode_payment_response_header(settled.decode())
    assert response.success and response.payer == str(wallet.pubkey()) == proof.payer
    assert response.network == offer.accepts[0].network and response.amount == str(amount)
    landed = await s.chain.transaction(Signature.from_string(response.transaction))
    assert landed is not None and landed.error is None
    assert await s.chain.token_balance(wallet.pubkey(), s.mint) == before - amount

    again, _ = await x402.pay(s, header(payload))  # the same payment sent again: not resent
    assert again == proof
    assert await s.chain.token_balance(wallet.pubkey(), s.mint) == before - amount


def altered(payload: PaymentPayload, terms: ExactTerms, wallet: Keypair, how: str) -> str:
    """The payload's transaction made again with one thing wrong, signed by ``wallet``."""
    tx = VersionedTransaction.from_bytes(base64.b64decode(payload.payload["transaction"]))
    blockhash = tx.message.recent_blockhash
    if how == "bad signature":
        forged = payment_transaction(Keypair(), terms, KVR_DECIMALS, blockhash)
        tx = VersionedTransaction.populate(
            payment_transaction(wallet, terms, KVR_DECIMALS, blockhash).message,
            forged.signatures)
    else:
        wrong = {"wrong amount": replace(terms, amount=terms.amount - 1),
                 "wrong mint": replace(terms, mint=Keypair().pubkey()),
                 "wrong payTo": replace(terms, pay_to=Keypair().pubkey())}[how]
        tx = payment_transaction(wallet, wrong, KVR_DECIMALS, blockhash)
    return base64.b64encode(bytes(tx)).decode()


@pytest.mark.parametrize(("how", "says"), [
    ("wrong amount", "ask for exactly"),
    ("wrong mint", "this gateway takes KVR"),
    ("wrong payTo", "not the vault"),
    ("bad signature", "signature does not verify"),
])
async def test_a_payment_that_breaks_its_requirements_is_refused_and_nothing_is_sent(
        s: Settlement, how: str, says: str) -> None:
    wallet = await consumer(s)
    offer = await required(s)
    payload = await signed(s, wallet, offer)
    req = offer.accepts[0]
    terms = ExactTerms(s.wallet.address, s.mint, s.wallet.address, int(req.amount),
                       req.extra["memo"])
    bad = payload.model_copy(update={"payload": {
        "transaction": altered(payload, terms, wallet, how)}})
    before = await s.chain.token_balance(wallet.pubkey(), s.mint)
    slot = (await s.chain.latest_blockhash())[1]
    with pytest.raises(PaymentRejected, match=says):
        await x402.pay(s, header(bad))
    assert (await s.chain.latest_blockhash())[1] == slot  # no transaction landed
    assert await s.chain.token_balance(wallet.pubkey(), s.mint) == before
    await x402.pay(s, header(payload))  # the honest payment of the same requirements lands


@pytest.mark.parametrize(("value", "says"), [
    (b"not base64!", "not base64-encoded JSON"),
    (x402.encoded({"x402Version": 1, "payload": {}}), "V2 payment payload"),
    (x402.encoded({"x402Version": 2, "accepted": {}, "payload": {"transaction": "AAAA"}}),
     "not a base64-encoded Solana transaction"),
])
async def test_a_malformed_payment_header_is_refused_naming_what_is_wrong(
        s: Settlement, value: bytes, says: str) -> None:
    with pytest.raises(PaymentRejected, match=says):
        await x402.pay(s, value)


async def test_a_payment_for_another_network_is_refused(s: Settlement) -> None:
    wallet = await consumer(s)
    payload = await signed(s, wallet, await required(s))
    elsewhere = payload.model_copy(update={"accepted": payload.accepted.model_copy(
        update={"network": "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"})})
    with pytest.raises(PaymentRejected, match="this gateway takes the exact scheme on solana:"):
        await x402.pay(s, header(elsewhere))


async def test_a_client_over_the_quote_limit_is_offered_nothing_and_told_when_to_ask(
        s: Settlement) -> None:
    offers = [await required(s) for _ in range(QUOTE_BURST + 1)]
    assert all(len(o.accepts) == 1 for o in offers[:-1])
    assert offers[-1].accepts == [] and offers[-1].error is not None
    assert "too many quotes from 127.0.0.1: wait" in offers[-1].error
