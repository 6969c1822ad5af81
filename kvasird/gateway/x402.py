"""x402 (HTTP 402 payments, V2) at a paid gateway: agents pay per call with the standard client.

    request without a payment      -> 402, PAYMENT-REQUIRED: base64 JSON
                                      {x402Version: 2, error, resource, accepts: [requirements]}
    the same request with PAYMENT-SIGNATURE: base64 JSON {x402Version: 2, accepted, payload:
                                      {transaction}}  -> the answer, PAYMENT-RESPONSE: base64
                                      JSON {success, transaction, network, payer, amount}

An x402 payment is a kvasird quote paid another way, so that every rule of today's payments
holds for it unchanged. The requirements of an unpaid request are a new quote for what the
request may use (its prompt once per choice, n × max_tokens, as ``/v1/kvasir/quote`` prices
the request's own body), offered as the ``exact`` scheme on Solana: the network as CAIP-2
(``solana:`` + the chain's genesis hash), the KVR mint as ``asset``, the quote's amount, the
vault's owner as ``payTo``, and in ``extra`` the gateway's wallet as ``feePayer`` and the
quote's public payment reference as ``memo``. The quote is made for the client's address,
so the quote rate limit bounds what unpaid requests may cost the gateway; over it, the 402
offers nothing and says when to ask again.

The gateway is its own facilitator. A PAYMENT-SIGNATURE's transaction names its quote by its
memo. Under the quote's lock, while the quote is open and unexpired (``Payments.settle_quote``),
it is checked against the quote's terms before the gateway's signature is sent anywhere
(``kvasird.settlement.x402.check_transfer``: the layout of the scheme, the mint, the vault,
the exact amount, the payer's signature, a fee payer that authorises nothing else), then
submitted co-signed as fee payer, unless the chain has it already; the quote is paid once
the chain proves the vault received it, and its transaction's signature is consumed once.
Then, as for
X-Kvasir-Payment: the payment must cover what the request may use, is redeemed by one
request, and what the answer leaves unused is credited to the payer's prepaid balance here
(a request cut short is refunded on chain; one that did no work leaves the payment usable,
and the same PAYMENT-SIGNATURE pays for it sent again). A replayed PAYMENT-SIGNATURE is the
same transaction (the fee payer's signature, the transaction's id, is deterministic): its
quote is paid by it already, so nothing is submitted again and the spent redemption refuses
it; a second transaction for a paid quote is refused without being submitted. Every
refusal of an x402 payment is a 402 that carries new requirements with its reason as
``error``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from solders.signature import Signature
from solders.transaction import VersionedTransaction

from kvasird.settlement.errors import ChainError, PaymentRejected, QuoteError
from kvasird.settlement.payments import PaymentProof, Quote
from kvasird.settlement.x402 import (
    SCHEME,
    ExactTerms,
    check_transfer,
    cosigned,
    decode_transaction,
    memo_of,
    network_id,
)

if TYPE_CHECKING:
    from solders.pubkey import Pubkey

    from kvasird.gateway.errors import PaymentRequired
    from kvasird.settlement.service import Settlement

VERSION = 2
"""The x402 protocol version spoken (V2: CAIP-2 networks, the PAYMENT-* headers)."""
SIGNATURE = b"payment-signature"
"""The request header that carries a payment (ASGI header names are lower case)."""
REQUIRED = b"payment-required"
"""The 402's header that carries the requirements."""
RESPONSE = b"payment-response"
"""The answer's header that carries the settlement."""


def encoded(obj: dict[str, Any]) -> bytes:
    """A header value: base64 of compact JSON."""
    return base64.b64encode(json.dumps(obj, separators=(",", ":")).encode())


def requirements(quote: Quote, network: str, fee_payer: Pubkey, timeout_s: float) -> dict[str, Any]:
    """The x402 PaymentRequirements paying ``quote`` by the exact scheme on Solana."""
    return {
        "scheme": SCHEME,
        "network": network,
        "asset": str(quote.mint),
        "amount": str(quote.amount),
        "payTo": str(quote.vault),
        "maxTimeoutSeconds": int(timeout_s),
        "extra": {"feePayer": str(fee_payer), "memo": quote.reference},
    }


def resource(scope: dict[str, Any]) -> dict[str, Any]:
    """What is paid for: the URL the request was sent to."""
    host = dict(scope.get("headers") or []).get(b"host", b"").decode(errors="replace")
    return {
        "url": f"{scope.get('scheme', 'http')}://{host}{scope.get('path', '')}",
        "description": "one generation of this gateway's model, paid in KVR",
        "mimeType": "application/json",
    }


async def offered(
    s: Settlement, scope: dict[str, Any], prompt: int, output: int, err: PaymentRequired
) -> PaymentRequired:
    """``err`` with a PAYMENT-REQUIRED header: x402 requirements for a request that may use
    ``prompt`` tokens in and ``output`` out (a new quote for the client), and ``err``'s
    message as their ``error``. Unchanged where this gateway cannot co-sign (it holds only
    its wallet's address)."""
    if s.wallet.keypair is None:
        return err
    client = (scope.get("client") or ("an unknown address",))[0]
    try:
        network = network_id(await s.chain.genesis_hash())
        quote = s.payments.quote(output, client, prompt)
    except (ChainError, QuoteError) as exc:
        accepts = []
        err.message += f" (no x402 requirements offered now: {exc})"
    else:
        ttl = s.config.section.quote_ttl_s
        accepts = [requirements(quote, network, s.wallet.keypair.pubkey(), ttl)]
        err.message += " (or pay this request with x402: see its PAYMENT-REQUIRED header)"
    required = {
        "x402Version": VERSION,
        "error": err.message,
        "resource": resource(scope),
        "accepts": accepts,
    }
    err.headers.append((REQUIRED, encoded(required)))
    return err


@dataclass(frozen=True)
class Offer:
    """A PAYMENT-SIGNATURE: an x402 V2 PaymentPayload of the exact scheme on Solana."""

    scheme: str
    """``accepted.scheme``."""
    network: str
    """``accepted.network`` (CAIP-2)."""
    transaction: VersionedTransaction
    """``payload.transaction``: the client-signed transfer."""

    @classmethod
    def from_header(cls, value: bytes) -> Offer:
        try:
            wire = json.loads(base64.b64decode(value, validate=True))
        except (ValueError, binascii.Error):
            raise PaymentRejected("PAYMENT-SIGNATURE is not base64-encoded JSON") from None
        if not isinstance(wire, dict) or wire.get("x402Version") != VERSION:
            raise PaymentRejected(f"PAYMENT-SIGNATURE must be an x402 V{VERSION} payment payload")
        accepted, payload = wire.get("accepted"), wire.get("payload")
        if not isinstance(accepted, dict) or not isinstance(payload, dict):
            raise PaymentRejected("PAYMENT-SIGNATURE lacks accepted or payload")
        transaction = payload.get("transaction")
        if not isinstance(transaction, str):
            raise PaymentRejected("PAYMENT-SIGNATURE lacks payload.transaction")
        return cls(
            str(accepted.get("scheme")),
            str(accepted.get("network")),
            decode_transaction(transaction),
        )


async def pay(s: Settlement, value: bytes) -> tuple[PaymentProof, bytes]:
    """Verify the PAYMENT-SIGNATURE ``value``, submit its payment as fee payer and settle
    the quote it pays: the proof, and the PAYMENT-RESPONSE value. PaymentRejected (or any
    settlement error) says why not."""
    keypair = s.wallet.keypair
    if keypair is None:
        raise PaymentRejected(
            "this gateway holds only its wallet's address and cannot co-sign x402 payments"
        )
    offer = Offer.from_header(value)
    network = network_id(await s.chain.genesis_hash())
    if (offer.scheme, offer.network) != (SCHEME, network):
        raise PaymentRejected(
            f"the payment is for the {offer.scheme} scheme on {offer.network}; this gateway "
            f"takes the {SCHEME} scheme on {network}"
        )
    tx = offer.transaction
    quote = s.payments.quote_of(memo_of(tx))
    if quote is None:
        raise PaymentRejected(
            "the transaction's memo names no requirements of this gateway: send the request "
            "without a payment for new ones"
        )
    terms = ExactTerms(keypair.pubkey(), quote.mint, quote.vault, quote.amount, quote.reference)
    signed = cosigned(tx, keypair)
    signature = signed.signatures[0]

    async def submit() -> None:
        check_transfer(tx, terms)
        if not (await s.chain.state(signature)).found:
            await s.chain.send(signed)
        landed = await s.chain.wait(signature, s.config.confirm_timeout_s)
        if landed.error is not None:
            raise PaymentRejected(
                f"the payment {signature} failed on chain ({landed.error}): no funds moved"
            )

    proof = await s.payments.settle_quote(quote.request_id, signature, submit)
    if proof.signature != str(signature):
        raise PaymentRejected(
            f"these requirements were paid by another transaction ({proof.signature}): "
            "send the request without a payment for new ones"
        )
    return proof, settlement(proof, signature, network)


def settlement(proof: PaymentProof, signature: Signature, network: str) -> bytes:
    """The PAYMENT-RESPONSE value: x402's SettleResponse of a landed payment."""
    return encoded(
        {
            "success": True,
            "transaction": str(signature),
            "network": network,
            "payer": proof.payer,
            "amount": str(proof.amount),
        }
    )
