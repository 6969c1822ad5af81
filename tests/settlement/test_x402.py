"""x402's exact scheme on Solana: what the gateway refuses to co-sign, and requirements that
expired are never submitted."""

from __future__ import annotations

import pytest
from solders.compute_budget import set_compute_unit_limit, set_compute_unit_price
from solders.hash import Hash
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import MessageV0, to_bytes_versioned
from solders.signature import Signature
from solders.system_program import TransferParams, transfer
from solders.transaction import VersionedTransaction
from spl.memo.constants import MEMO_PROGRAM_ID
from spl.token.constants import TOKEN_PROGRAM_ID
from spl.token.instructions import transfer_checked
from spl.token.models import TransferCheckedParams

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import PaymentRejected, QuoteError
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.payments import Payments
from kvasird.settlement.pricing import PriceController
from kvasird.settlement.token import KVR_DECIMALS, token_account
from kvasird.settlement.x402 import (
    ExactTerms,
    check_transfer,
    cosigned,
    network_id,
    payment_transaction,
)

from .conftest import Clock

GATEWAY = Keypair()
TERMS = ExactTerms(GATEWAY.pubkey(), Keypair().pubkey(), GATEWAY.pubkey(), 1234, "kvasir:ab12")


def test_a_clients_payment_passes_and_its_cosigned_id_is_the_fee_payers_signature() -> None:
    payer = Keypair()
    tx = payment_transaction(payer, TERMS, KVR_DECIMALS, Hash.default())
    assert check_transfer(tx, TERMS) == payer.pubkey()
    signed = cosigned(tx, GATEWAY)
    assert signed.signatures[0].verify(GATEWAY.pubkey(), to_bytes_versioned(signed.message))
    assert cosigned(tx, GATEWAY).signatures[0] == signed.signatures[0]  # a replay: same id


def test_the_fee_payer_is_never_made_to_transfer_its_own_tokens() -> None:
    tx = payment_transaction(GATEWAY, TERMS, KVR_DECIMALS, Hash.default())
    with pytest.raises(PaymentRejected, match="exactly two signers|fee payer appears"):
        check_transfer(tx, TERMS)


def test_a_payment_that_also_moves_the_fee_payers_sol_is_refused() -> None:
    payer = Keypair()
    drain = transfer(TransferParams(from_pubkey=GATEWAY.pubkey(), to_pubkey=payer.pubkey(),
                                    lamports=10**9))
    message = MessageV0.try_compile(GATEWAY.pubkey(), [
        set_compute_unit_limit(20_000),
        set_compute_unit_price(1),
        transfer_checked(TransferCheckedParams(
            program_id=TOKEN_PROGRAM_ID, source=token_account(payer.pubkey(), TERMS.mint),
            mint=TERMS.mint, dest=token_account(TERMS.pay_to, TERMS.mint), owner=payer.pubkey(),
            amount=TERMS.amount, decimals=KVR_DECIMALS)),
        Instruction(MEMO_PROGRAM_ID, TERMS.memo.encode(), []),
        drain,
    ], [], Hash.default())
    tx = VersionedTransaction.populate(
        message, [Signature.default(), payer.sign_message(to_bytes_versioned(message))])
    with pytest.raises(PaymentRejected, match="the exact scheme is a compute-unit limit"):
        check_transfer(tx, TERMS)


def test_a_local_chains_network_is_named_by_its_genesis_hash_as_caip2() -> None:
    assert network_id("EtWTRABZaYq6iMfeYKouRu166VU2xqa1extra") == (
        "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1")


async def test_expired_requirements_are_refused_before_anything_is_submitted(
        chain: ChainClient, local_chain: LocalChainInfo, ledger: Ledger, clock: Clock) -> None:
    payments = Payments(ledger, chain, vault=GATEWAY.pubkey(), mint=local_chain.mint,
                        prices=PriceController(), locks=KeyedLocks(), quote_ttl_s=60, clock=clock)
    quote = payments.quote(max_tokens=100)
    clock.now += 61
    submitted = []

    async def submit() -> None:
        submitted.append(True)

    with pytest.raises(QuoteError, match="expired"):
        await payments.settle_quote(quote.request_id, Signature.default(), submit)
    assert submitted == []
