"""Payments: only what the chain proves is credited, each signature once."""

from __future__ import annotations

import pytest
import trio
from solders.keypair import Keypair
from solders.signature import Signature
from solders.system_program import CreateAccountParams, create_account
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import initialize_mint2
from spl.token.models import InitializeMint2Params

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import PaymentRejected, QuoteError, SignatureAlreadyUsed
from kvasird.settlement.localchain import LocalChainInfo
from kvasird.settlement.token import mint_instructions

from .conftest import KVR, Gateway, funded, pay


async def test_honest_quote_payment_is_credited(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    consumer = await funded(chain, local_chain, 10 * KVR)
    quote = gateway.payments.quote(max_tokens=1000)
    sig = await pay(
        chain, consumer, gateway.wallet, local_chain.mint, quote.amount, quote.reference.encode()
    )
    proof = await gateway.payments.settle_quote(quote.request_id, sig)
    assert (proof.amount, proof.payer, proof.signature) == (
        quote.amount,
        str(consumer.pubkey()),
        str(sig),
    )
    assert await chain.token_balance(gateway.wallet.pubkey(), local_chain.mint) == quote.amount


async def test_resubmitting_a_paid_quote_returns_the_same_result(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    consumer = await funded(chain, local_chain, 10 * KVR)
    quote = gateway.payments.quote(max_tokens=500)
    sig = await pay(
        chain, consumer, gateway.wallet, local_chain.mint, quote.amount, quote.reference.encode()
    )
    first = await gateway.payments.settle_quote(quote.request_id, sig)
    assert await gateway.payments.settle_quote(quote.request_id, sig) == first


async def test_replayed_victim_signature_under_attacker_wallet_is_rejected(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    victim = await funded(chain, local_chain, 10 * KVR)
    attacker = Keypair()
    sig = await pay(chain, victim, gateway.wallet, local_chain.mint, 5 * KVR)
    with pytest.raises(PaymentRejected, match="not sent by owner"):
        await gateway.payments.deposit(attacker.pubkey(), sig, 5 * KVR)
    assert gateway.payments.deposit_balance(attacker.pubkey()) == 0
    await gateway.payments.deposit(victim.pubkey(), sig, 5 * KVR)  # the victim can still use it
    assert gateway.payments.deposit_balance(victim.pubkey()) == 5 * KVR


async def test_same_signature_credits_once(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    sender = await funded(chain, local_chain, 10 * KVR)
    sig = await pay(chain, sender, gateway.wallet, local_chain.mint, 3 * KVR)
    results = []

    async def deposit() -> None:
        try:
            results.append((await gateway.payments.deposit(sender.pubkey(), sig, 3 * KVR)).amount)
        except SignatureAlreadyUsed:
            results.append(0)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(deposit)
    assert sorted(results) == [0, 0, 3 * KVR]
    assert gateway.payments.deposit_balance(sender.pubkey()) == 3 * KVR


async def test_signature_that_paid_one_quote_cannot_pay_another(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    consumer = await funded(chain, local_chain, 10 * KVR)
    first, second = gateway.payments.quote(100), gateway.payments.quote(100)
    sig = await pay(
        chain, consumer, gateway.wallet, local_chain.mint, first.amount, first.reference.encode()
    )
    await gateway.payments.settle_quote(first.request_id, sig)
    with pytest.raises(PaymentRejected, match="payment reference"):
        await gateway.payments.settle_quote(second.request_id, sig)
    with pytest.raises(SignatureAlreadyUsed):
        await gateway.payments.deposit(consumer.pubkey(), sig, first.amount)


async def test_payment_without_the_quote_reference_is_rejected(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    consumer = await funded(chain, local_chain, 10 * KVR)
    quote = gateway.payments.quote(100)
    sig = await pay(
        chain, consumer, gateway.wallet, local_chain.mint, quote.amount, b"kvasir:someone-else"
    )
    with pytest.raises(PaymentRejected, match="payment reference"):
        await gateway.payments.settle_quote(quote.request_id, sig)


async def test_over_claimed_amount_is_rejected(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    sender = await funded(chain, local_chain, 10 * KVR)
    sig = await pay(chain, sender, gateway.wallet, local_chain.mint, 2 * KVR)
    with pytest.raises(PaymentRejected, match="less than"):
        await gateway.payments.deposit(sender.pubkey(), sig, 3 * KVR)


async def test_payment_to_another_vault_is_rejected(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    sender = await funded(chain, local_chain, 10 * KVR)
    sig = await pay(chain, sender, Keypair(), local_chain.mint, 2 * KVR)
    with pytest.raises(PaymentRejected, match="did not pay the vault"):
        await gateway.payments.deposit(sender.pubkey(), sig, 2 * KVR)


async def test_payment_in_another_mint_is_rejected(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    forger = await funded(chain, local_chain)
    fake_mint = Keypair()
    rent = (await chain._rpc.get_minimum_balance_for_rent_exemption(82)).value
    await chain.send_and_confirm(
        [forger, fake_mint],
        [
            create_account(
                CreateAccountParams(
                    from_pubkey=forger.pubkey(),
                    to_pubkey=fake_mint.pubkey(),
                    lamports=rent,
                    space=82,
                    owner=TOKEN_PROGRAM_ID,
                )
            ),
            initialize_mint2(
                InitializeMint2Params(
                    decimals=6,
                    program_id=TOKEN_PROGRAM_ID,
                    mint=fake_mint.pubkey(),
                    mint_authority=forger.pubkey(),
                )
            ),
            *mint_instructions(forger.pubkey(), forger.pubkey(), fake_mint.pubkey(), 10 * KVR),
        ],
    )
    sig = await pay(chain, forger, gateway.wallet, fake_mint.pubkey(), 5 * KVR)
    with pytest.raises(PaymentRejected, match="not KVR"):
        await gateway.payments.deposit(forger.pubkey(), sig, 5 * KVR)


async def test_failed_transaction_is_rejected(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    from kvasird.settlement.token import transfer_instructions

    sender = await funded(chain, local_chain, KVR)
    tx = await chain.sign(
        [sender],
        transfer_instructions(sender.pubkey(), gateway.wallet.pubkey(), local_chain.mint, 2 * KVR),
    )
    sig = await chain.send(tx, preflight=False)
    await chain.wait(sig, 5)
    with pytest.raises(PaymentRejected, match="failed on chain"):
        await gateway.payments.deposit(sender.pubkey(), sig, 2 * KVR)


async def test_unknown_signature_is_rejected(gateway: Gateway) -> None:
    quote = gateway.payments.quote(100)
    with pytest.raises(PaymentRejected, match="unknown"):
        await gateway.payments.settle_quote(quote.request_id, Signature.new_unique())


async def test_unknown_request_id_is_rejected(gateway: Gateway) -> None:
    with pytest.raises(QuoteError, match="unknown request id"):
        await gateway.payments.settle_quote("made-up", Signature.new_unique())


async def test_prepaid_balance_pays_a_quote_once(
    chain: ChainClient, local_chain: LocalChainInfo, gateway: Gateway
) -> None:
    sender = await funded(chain, local_chain, 10 * KVR)
    quote = gateway.payments.quote(1000)
    sig = await pay(chain, sender, gateway.wallet, local_chain.mint, quote.amount)
    await gateway.payments.deposit(sender.pubkey(), sig, quote.amount)
    first = await gateway.payments.pay_quote_from_deposit(sender.pubkey(), quote.request_id)
    assert gateway.payments.deposit_balance(sender.pubkey()) == 0
    again = await gateway.payments.pay_quote_from_deposit(sender.pubkey(), quote.request_id)
    assert again == first  # asked again: the same payment, not a second one
    with pytest.raises(QuoteError):  # nobody else pays a quote that is paid
        await gateway.payments.pay_quote_from_deposit(Keypair().pubkey(), quote.request_id)
