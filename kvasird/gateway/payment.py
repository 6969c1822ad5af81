"""Pay-per-inference at the gateway: quote -> payment on chain -> inference -> receipts.

    POST /v1/kvasir/quote {"max_tokens": N}   -> a quote: request_id (secret), memo, amount, vault
    the consumer transfers `amount` KVR to the vault with `memo` on chain
    any generation request with  X-Kvasir-Payment: <request_id>:<signature>

The payment is verified on chain by the settlement subsystem (the vault received the
amount with the quote's memo: credit only what the chain proves). Each paid quote serves
one request: it is redeemed in the same database transaction that checks it was unused.
After the generation the amount is split by the work the gateway measured itself.
"""

from __future__ import annotations

import ipaddress
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from solders.signature import Signature

from kvasird.errors import KvasirError
from kvasird.gateway.errors import BadRequest, PaymentRequired
from kvasird.logs import get_logger
from kvasird.settlement.payments import PaymentProof
from kvasird.settlement.rewards import MeasuredWork

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
        if s.config.free_local and _loopback(client):
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
    covered = s.payments.quoted_tokens(proof.key)
    if covered < job.request.sampling.max_tokens:
        raise PaymentRequired(f"the quote covers {covered} tokens but the request asks for up to "
                              f"{job.request.sampling.max_tokens}: lower max_tokens or get a "
                              "bigger quote")
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


def record_work(gw: Gateway, proof: PaymentProof, job: Job, tokens: int, seconds: float) -> None:
    """Split the payment by the work this gateway measured (never what peers claim)."""
    s = settlement_of(gw)
    if s is None or gw.node is None:
        return
    n_layer = gw.node.market.model.n_layer if gw.node.market.model else 1
    work = [MeasuredWork(peer, MeasuredWork.stage_units(max(tokens, 1), layers),
                         1000.0 * seconds / max(tokens, 1))
            for peer, layers in _workers(gw, job, n_layer)]
    try:
        rewards, _ = s.gateway()
        split = rewards.settle(proof.key, work, epoch=int(time.time() // 3600))
    except KvasirError as exc:
        log.warning("could not settle a paid request", request_id=proof.key, error=str(exc))
        return
    log.info("paid request settled", amount=proof.amount, workers=split.workers,
             operator=split.operator, insurance=split.insurance)


def _workers(gw: Gateway, job: Job, n_layer: int) -> list[tuple[str, int]]:
    """Who did the work of ``job`` and how many layers each ran, as this node measured it."""
    route = getattr(job.generator, "route_of", None)
    stages = route(job.request.request_id) if route is not None else None
    if stages:
        return [(peer, layers) for peer, layers in stages]
    assert gw.node is not None
    return [(gw.node.p2p.peer_id, n_layer)]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def quote(gw: Gateway, max_tokens: int) -> dict[str, Any]:
    s = settlement_of(gw)
    if s is None:
        raise BadRequest("this gateway takes no payments ([settlement] is off): requests are free")
    return s.payments.quote(max_tokens).to_wire()
