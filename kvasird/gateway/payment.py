"""Pay-per-inference at the gateway: quote -> payment on chain -> inference -> receipts.

    POST /v1/kvasir/quote {"max_tokens": N}   -> a quote: request_id (secret), memo, amount, vault
        ({"max_tokens": N, "n": K} for a request of K choices: it may generate K x N tokens)
    the consumer transfers `amount` KVR to the vault with `memo` on chain
    any generation request with  X-Kvasir-Payment: <request_id>:<signature>

The payment is verified on chain by the settlement subsystem (the vault received the
amount with the quote's memo: credit only what the chain proves). Each paid quote serves
one request: it is redeemed in the same database transaction that checks it was unused.
After the generation the amount is split by the work the gateway measured itself (the
generator's record of every hop that served it), and each peer that worked is sent its new
cumulative receipt. A paid request that fails is refunded on chain, from the insurance
pool, for the part that was not served; the client's error names the refund transaction.
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING, Any

from solders.signature import Signature

from kvasird.errors import KvasirError
from kvasird.gateway.errors import BadRequest, PaymentRequired, TooManyRequests
from kvasird.http import is_loopback
from kvasird.logs import get_logger
from kvasird.settlement.errors import QuotesTooFrequent
from kvasird.settlement.exchange import epoch_now
from kvasird.settlement.payments import PaymentProof
from kvasird.settlement.rewards import MeasuredWork, SplitResult
from kvasird.settlement.token import format_kvr

if TYPE_CHECKING:
    from kvasird.gateway.service import Gateway, Job
    from kvasird.settlement.service import Settlement

log = get_logger("kvasird.gateway.payment")

HEADER = b"x-kvasir-payment"
HOW = ("ask for a quote with POST /v1/kvasir/quote {\"max_tokens\": N}, transfer its amount of "
       "KVR to its vault with its memo, and send the request again with the header "
       "X-Kvasir-Payment: <request_id>:<transaction signature>")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS gateway_redeemed (
    request_id TEXT PRIMARY KEY,
    redeemed_at REAL NOT NULL
);
"""


def settlement_of(gw: Gateway) -> Settlement | None:
    return getattr(gw.node, "settlement", None) if gw.node is not None else None


async def charge(gw: Gateway, scope: dict[str, Any], job: Job) -> PaymentProof | None:
    """The payment that covers ``job``, or None when this request is free; else 402."""
    s = settlement_of(gw)
    if s is None:
        return None
    header = dict(scope.get("headers") or []).get(HEADER)
    if header is None:
        client = (scope.get("client") or ("", 0))[0]
        if s.config.free_local and is_loopback(client):
            return None
        raise PaymentRequired(f"this gateway takes KVR payments: {HOW}")
    request_id, _, sig = header.decode(errors="replace").partition(":")
    try:
        signature = Signature.from_string(sig.strip())
    except ValueError:
        raise BadRequest("X-Kvasir-Payment must be <request_id>:<base58 signature>",
                         "X-Kvasir-Payment") from None
    try:
        proof = await s.payments.settle_quote(request_id.strip(), signature)
    except KvasirError as exc:
        raise PaymentRequired(f"payment not accepted: {exc}") from None
    covered, asked = s.payments.quoted_tokens(proof.key), job.n * job.request.sampling.max_tokens
    if covered < asked:
        each = f" ({job.n} choices of up to {job.request.sampling.max_tokens})" if job.n > 1 else ""
        raise PaymentRequired(f"the quote covers {covered} tokens but the request asks for up to "
                              f"{asked}{each}: lower max_tokens or n, or get a bigger quote")
    _redeem(gw, proof.key)
    return proof


def _redeem(gw: Gateway, request_id: str) -> None:
    assert gw.node is not None
    db: sqlite3.Connection = gw.node.db
    db.executescript(_SCHEMA)
    try:
        with db:
            db.execute("INSERT INTO gateway_redeemed VALUES (?, ?)", (request_id, time.time()))
    except sqlite3.IntegrityError:
        raise PaymentRequired("this payment has already been used for a request: pay a new "
                              "quote") from None


def record_work(gw: Gateway, proof: PaymentProof, job: Job, tokens: int, seconds: float,
                served: int | None = None) -> SplitResult | None:
    """Split the payment (or its ``served`` part) by the work this gateway measured — never
    by what peers claim — and send each peer that worked its new receipt."""
    s = settlement_of(gw)
    if s is None or gw.node is None:
        return None
    work = _measured(gw, job, tokens, seconds)
    epoch = epoch_now()
    try:
        rewards, _ = s.gateway()
        split = rewards.settle(proof.key, work, epoch, served)
    except KvasirError as exc:
        log.warning("could not settle a paid request", request_id=proof.key, error=str(exc))
        return None
    log.info("paid request settled", amount=proof.amount, workers=split.workers,
             operator=split.operator, insurance=split.insurance)
    if gw.node.exchange is not None:
        gw.node.exchange.deliver([w.peer_id for w in work], epoch)
    return split


async def refund(gw: Gateway, proof: PaymentProof, job: Job, tokens: int,
                 seconds: float) -> str:
    """A paid request failed after ``tokens`` tokens: settle what was served, refund the
    rest on chain; returns the sentence the client's error ends with."""
    s = settlement_of(gw)
    assert s is not None
    quoted = max(s.payments.quoted_tokens(proof.key), 1)
    served = proof.amount * min(tokens, quoted) // quoted  # rounded in the payer's favour
    if record_work(gw, proof, job, tokens, seconds, served) is None:
        return ""
    try:
        _, payouts = s.gateway()
        payout = await payouts.refund(proof.key)
    except KvasirError as exc:
        log.warning("refund not sent", request_id=proof.key, error=str(exc))
        return (f" A refund of {format_kvr(proof.amount - served)} KVR is owed to you but "
                f"could not be sent yet ({exc}); the gateway's log has it.")
    log.info("paid request refunded", amount=payout.amount, signature=payout.signature)
    return (f" {format_kvr(payout.amount)} KVR of your payment (the part not served) was "
            f"refunded to {payout.recipient}: transaction {payout.signature}.")


def _measured(gw: Gateway, job: Job, tokens: int, seconds: float) -> list[MeasuredWork]:
    """Who did the work of ``job`` and how much, as this node measured it: the generator's
    record of every hop of every choice, or (a generator that ran here alone) this node for
    all of it: each choice computed the prompt and its own tokens."""
    done = [w for r in job.requests() for w in job.generator.work(r.request_id)]
    if done:
        return [MeasuredWork(w.peer, w.units, w.ms_per_token) for w in done]
    assert gw.node is not None
    n_layer = gw.node.market.model.n_layer if gw.node.market.model else 1
    positions = job.n * len(job.request.prompt) + tokens
    return [MeasuredWork(gw.node.p2p.peer_id, MeasuredWork.stage_units(positions, n_layer + 1),
                         1000.0 * seconds / max(tokens, 1))]


def quote(gw: Gateway, max_tokens: int, client: str) -> dict[str, Any]:
    """A quote for ``client`` (an address: each may ask only so often, each quote is a row)."""
    s = settlement_of(gw)
    if s is None:
        raise BadRequest("this gateway takes no payments ([settlement] is off): requests are free")
    try:
        return s.payments.quote(max_tokens, client).to_wire()
    except QuotesTooFrequent as exc:
        raise TooManyRequests(str(exc), code="too_many_quotes") from None
