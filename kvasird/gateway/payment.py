"""Pay-per-inference at the gateway: quote -> payment on chain -> inference -> receipts.

    POST /v1/kvasir/quote {"prompt_tokens": P, "max_tokens": N, "n": K}
        -> a quote: request_id (secret), memo, amount, vault, the prices per 1000 input and
           output tokens (or POST the very body of the request to be paid: the gateway
           counts its prompt and reads its max_tokens and n)
    the consumer transfers `amount` KVR to the vault with `memo` on chain
    any generation request with  X-Kvasir-Payment: <request_id>:<signature>

The payment is verified on chain by the settlement subsystem (the vault received the
amount with the quote's memo: credit only what the chain proves). A request is served only
if what it may use, its tokenized prompt (once per choice) and n × max_tokens, costs no more
than was paid at the quote's prices; else 402 names the amount still needed, and the payment
stays usable for a request within it. Each paid quote serves one request: it is redeemed in
the same database transaction that checks it was unused. After the generation its cost is
what it used (the prompt and the tokens produced); what a shorter answer left unused is
credited to the payer's prepaid balance at this gateway (``GET /v1/kvasir/balance/<wallet>``),
which pays a later quote when the request carries
``X-Kvasir-Payment: <request_id>:<wallet>:<the wallet's signature of prepaid_message>``.
The cost is split by the work the gateway measured itself (the generator's record of every
hop that served it, prefill included), and each peer that worked is sent its new cumulative
receipt. A paid request refused or failed before its first token costs nothing: its payment
stays usable, and the same header pays for the request sent again (a payment not yet
verified is verified then, so that it outlives its quote); the error says so (``UNUSED``).
One cut short after its first token is refunded on chain, from the insurance pool, for the
part that was not served; the client's error names the refund transaction.

x402 (x402.py) is the same quote paid by the standard HTTP 402 client: an unpaid request's
402 also carries x402 requirements (a quote for it), and a PAYMENT-SIGNATURE pays that quote
by a transfer this gateway co-signs and submits itself; from there the rules above hold.

The operator's own requests (from this machine, [settlement] free_local) need no quote, but
they are not free for the peers: each is a quote the vault pays itself (``operator_quote``),
settled and receipted like any other, so the peers are paid for it from the operator's
balance. It is served only while the vault holds what it may cost above the network's stake
minimum and what the vault owes (peers' unclaimed earnings, the insurance pool, consumers'
prepaid balances); else 402 says how to top up. The response says who paid
(``X-Kvasir-Paid-By``) and the most it may cost (``X-Kvasir-Max-Cost``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from solders.signature import Signature

from kvasird.errors import KvasirError
from kvasird.gateway import x402
from kvasird.gateway.errors import BadRequest, PaymentRequired, TooManyRequests
from kvasird.http import operator_request
from kvasird.logs import get_logger
from kvasird.settlement.errors import ChainError, PaymentRejected, QuotesTooFrequent
from kvasird.settlement.exchange import epoch_now
from kvasird.settlement.payments import Coverage, PaymentProof, prepaid_message
from kvasird.settlement.rewards import MeasuredWork, SplitResult
from kvasird.settlement.token import format_kvr
from kvasird.settlement.wallet import parse_address

if TYPE_CHECKING:
    from solders.pubkey import Pubkey

    from kvasird.gateway.service import Gateway, Job
    from kvasird.settlement.exchange import Exchange
    from kvasird.settlement.service import Settlement

log = get_logger("kvasird.gateway.payment")

HEADER = b"x-kvasir-payment"
HOW = (
    'ask for a quote with POST /v1/kvasir/quote {"prompt_tokens": P, "max_tokens": N} '
    "(or with the request's own body), transfer its amount of KVR to its vault with its "
    "memo, and send the request again with the header "
    "X-Kvasir-Payment: <request_id>:<transaction signature>"
)
UNUSED = (
    " Nothing was charged: your payment is unused, and the same X-Kvasir-Payment header "
    "pays for the request sent again (corrected, or once the gateway can serve it)."
)
"""How every error of a paid request that did no work ends: the rule is one for all."""


@dataclass(frozen=True)
class Settling:
    """What the gateway's payments use of the node it runs on (the daemon builds it):
    settlement and the receipt exchange start after the gateway is built, hence callables."""

    settlement: Callable[[], Settlement | None]
    """Payments and rewards (None while [settlement] is off or not started yet)."""
    exchange: Callable[[], Exchange | None]
    """Where receipts go out to the peers (None while settlement is off)."""
    me: str
    """This node's peer id: who did the work of a generation that ran here alone."""
    layers: Callable[[], int]
    """Layers of the model served (1 while the market has none): that work's units."""


@dataclass(frozen=True)
class Charge:
    """Who pays for a request, and what it may cost."""

    proof: PaymentProof
    """The paid quote that covers it."""
    coverage: Coverage
    """What that quote pays for, at its prices."""
    operator: bool
    """The operator's own request, paid by the vault itself."""
    settled: bytes = b""
    """x402's PAYMENT-RESPONSE value, when an x402 payment paid it (see x402.py)."""

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers that say who pays and the most it may cost (and, for an x402
        payment, its settlement)."""
        who = f"operator {self.proof.payer}" if self.operator else "payment"
        return [
            (b"x-kvasir-paid-by", who.encode()),
            (b"x-kvasir-max-cost", str(self.coverage.amount).encode()),
            *([(x402.RESPONSE, self.settled)] if self.settled else []),
        ]


def settlement_of(gw: Gateway) -> Settlement | None:
    return gw.settling.settlement() if gw.settling is not None else None


def _asks(job: Job) -> tuple[int, int]:
    """(prompt tokens, output tokens) a request may use: every choice computes the prompt."""
    return job.prompt_positions, job.n * job.request.sampling.max_tokens


async def charge(gw: Gateway, scope: dict[str, Any], job: Job) -> Charge | None:
    """Who pays for ``job``: a paid quote, or the operator for its own request; None when
    this gateway takes no payments; else 402 saying what to pay."""
    s = settlement_of(gw)
    if s is None:
        return None
    headers = dict(scope.get("headers") or [])
    header, offer = headers.get(HEADER), headers.get(x402.SIGNATURE)
    if header is None and offer is not None:
        try:
            return await _x402_charge(s, job, offer)
        except PaymentRequired as err:
            raise await x402.offered(s, scope, *_asks(job), err) from None
    if header is None:
        if gw.free_local and operator_request(scope):
            return await _operator_charge(gw, s, job)
        unpaid = PaymentRequired(f"this gateway takes KVR payments: {HOW}")
        raise await x402.offered(s, scope, *_asks(job), unpaid)
    request_id, owner, signature = _parsed(header)
    try:
        if owner is None:
            proof = await s.payments.settle_quote(request_id, signature)
        else:
            if not signature.verify(owner, prepaid_message(request_id)):
                raise PaymentRejected(f"the signature is not {owner}'s over this request id")
            proof = await s.payments.pay_quote_from_deposit(owner, request_id)
    except KvasirError as exc:
        raise PaymentRequired(f"payment not accepted: {exc}") from None
    return _covered(s, job, proof)


async def _x402_charge(s: Settlement, job: Job, offer: bytes) -> Charge:
    """An x402 PAYMENT-SIGNATURE: its payment verified, submitted and settled here, then
    held to the same rules as an X-Kvasir-Payment."""
    try:
        proof, settled = await x402.pay(s, offer)
    except KvasirError as exc:
        raise PaymentRequired(f"payment not accepted: {exc}") from None
    return replace(_covered(s, job, proof), settled=settled)


def _covered(s: Settlement, job: Job, proof: PaymentProof) -> Charge:
    """The charge of a paid quote, if it covers what ``job`` may use and no request spent
    it yet (it is redeemed now); else 402."""
    coverage = s.payments.coverage(proof.key)
    assert coverage is not None
    prompt, output = _asks(job)
    need = coverage.cost(prompt, output)
    if need > coverage.amount:
        each = f" ({job.n} choices of up to {job.request.sampling.max_tokens})" if job.n > 1 else ""
        raise PaymentRequired(
            f"this request may use {prompt} prompt tokens and {output} output tokens{each}, "
            f"which cost {format_kvr(need)} KVR at the quote's prices, and the payment covers "
            f"{format_kvr(coverage.amount)} KVR: {format_kvr(need - coverage.amount)} KVR more "
            f'is needed. Ask for a quote of {{"prompt_tokens": {prompt}, "max_tokens": '
            f"{output}}} (or POST the request's body to /v1/kvasir/quote), or lower max_tokens "
            "or n; this payment stays usable for a request within it"
        )
    if not s.redemptions.redeem(proof.key):
        raise PaymentRequired("this payment has already been used for a request: pay a new quote")
    return Charge(proof, coverage, operator=False)


def _parsed(header: bytes) -> tuple[str, Pubkey | None, Signature]:
    """(request id, the prepaid balance's owner or None for a transfer, signature)."""
    parts = [p.strip() for p in header.decode(errors="replace").split(":")]
    try:
        signature = Signature.from_string(parts[-1])
        owner = parse_address(parts[1]) if len(parts) == 3 else None
    except (ValueError, KvasirError):
        owner = signature = None
    if len(parts) not in (2, 3) or signature is None:
        raise BadRequest(
            "X-Kvasir-Payment must be <request_id>:<transaction signature>, or "
            "<request_id>:<wallet>:<the wallet's signature of the request id> to "
            "pay from the wallet's prepaid balance here",
            "X-Kvasir-Payment",
        )
    return parts[0], owner, signature


async def unused(gw: Gateway, header: bytes) -> str:
    """A paid request refused before its payment was taken (an unknown model, a bad field,
    a gateway not ready): the sentence its error ends with. A transfer is verified now, so
    that the payment stays usable after its quote expires; a prepaid one was never taken."""
    s = settlement_of(gw)
    if s is None:
        return ""
    try:
        request_id, owner, signature = _parsed(header)
    except BadRequest:
        return ""
    if s.payments.coverage(request_id) is None or s.redemptions.redeemed(request_id):
        return ""  # no such quote here, or its payment was spent already
    if owner is None:
        try:
            await s.payments.settle_quote(request_id, signature)
        except KvasirError as exc:
            log.info("a refused request's payment is not verified", error=str(exc)[:200])
    return UNUSED


async def _operator_charge(gw: Gateway, s: Settlement, job: Job) -> Charge:
    """The operator's own request: a quote the vault pays itself, if it can afford it."""
    assert gw.settling is not None
    return await operator_charge(s, gw.settling.me, *_asks(job))


async def operator_charge(s: Settlement, me: str, prompt: int, output: int) -> Charge:
    """A quote the vault pays itself for ``prompt`` tokens in and ``output`` out (node ``me``),
    if the operator's wallet can afford it above the stake and what it owes; else 402."""
    if s.rewards is None:
        raise PaymentRequired(
            "this machine's requests are paid to the peers from the "
            f"operator's wallet, and only the address {s.wallet.address} is "
            "configured: set [settlement] wallet to its keypair file"
        )
    need = s.prices.amount_for(output, prompt)
    try:
        held = await s.chain.token_balance(s.wallet.address, s.mint)
    except ChainError as exc:
        raise PaymentRequired(
            f"this machine's requests are paid from the operator's wallet, "
            f"whose balance cannot be read from the chain now ({exc}): "
            "retry shortly"
        ) from None
    stake = s.governance.params().stake_min
    if held < stake:
        raise PaymentRequired(
            f"this machine's requests are paid from the operator's wallet {s.wallet.address}, "
            f"which holds {format_kvr(held)} KVR, below the network's stake minimum of "
            f"{format_kvr(stake)} KVR: the peers serve no gateway below it. Send KVR to "
            f"{s.wallet.address} to top it up"
        )
    spare = held - stake - s.owed(me)
    if spare < need:
        raise PaymentRequired(
            f"this machine's requests are paid from the operator's wallet {s.wallet.address}, "
            f"which has {format_kvr(max(spare, 0))} KVR to spend above the network's stake "
            f"minimum and what it owes, and this request may cost {format_kvr(need)} KVR: "
            f"send KVR to {s.wallet.address} to top it up (or lower max_tokens)"
        )
    quote = s.payments.operator_quote(output, prompt)
    proof = PaymentProof(quote.request_id, "", quote.amount, str(s.wallet.address))
    coverage = s.payments.coverage(quote.request_id)
    assert coverage is not None
    return Charge(proof, coverage, operator=True)


def record_work(
    gw: Gateway, charge: Charge, job: Job, tokens: int, seconds: float, served: int | None = None
) -> SplitResult | None:
    """Split what the request used (or the ``served`` part of a failed one) by the work this
    gateway measured — never by what peers claim — and send each peer that worked its new
    receipt."""
    s = settlement_of(gw)
    if s is None or gw.settling is None:
        return None
    work = _measured(gw.settling, job, tokens, seconds)
    return settle_work(s, gw.settling.exchange(), charge, work, _asks(job)[0], tokens, served)


def settle_work(
    s: Settlement,
    exchange: Exchange | None,
    charge: Charge,
    work: list[MeasuredWork],
    prompt: int,
    tokens: int,
    served: int | None = None,
) -> SplitResult | None:
    """Settle ``charge`` for ``prompt`` tokens in and ``tokens`` out by ``work``, and queue
    each peer's new receipt (the gateway's requests and the admin API's generations)."""
    epoch = epoch_now()
    used = charge.coverage.cost(prompt, tokens)
    try:
        rewards, _ = s.gateway()
        split = rewards.settle(charge.proof.key, work, epoch, served, used)
    except KvasirError as exc:
        log.warning("could not settle a paid request", request_id=charge.proof.key, error=str(exc))
        return None
    log.info(
        "paid request settled",
        used=used,
        paid=charge.proof.amount,
        operator=charge.operator,
        workers=split.workers,
        fee=split.operator,
        insurance=split.insurance,
    )
    if exchange is not None:
        exchange.deliver([w.peer_id for w in work], epoch)
    return split


@dataclass(frozen=True)
class OwnUse:
    """The operator's generations outside the gateway's HTTP API (the admin API's
    ``/v0/generate``, ``kvasird generate``): charged to its wallet and receipted to the
    peers like the gateway's own requests."""

    settlement: Settlement
    me: str
    """This node's peer id."""
    exchange: Exchange | None
    """Where receipts go out."""

    async def charge(self, prompt: int, output: int) -> Charge:
        return await operator_charge(self.settlement, self.me, prompt, output)

    def settle(self, charge: Charge, work: list[MeasuredWork], prompt: int, tokens: int) -> None:
        settle_work(self.settlement, self.exchange, charge, work, prompt, tokens)


async def refund(gw: Gateway, charge: Charge, job: Job, tokens: int, seconds: float) -> str:
    """A paid request failed after ``tokens`` tokens: before the first, its payment is
    released (``UNUSED``); after it, what was served is settled and the rest refunded on
    chain. Returns the sentence the client's error ends with."""
    s = settlement_of(gw)
    assert s is not None
    proof = charge.proof
    served = min(charge.coverage.cost(_asks(job)[0], tokens), proof.amount) if tokens else 0
    if charge.operator:  # the operator paid itself: what was not served was never spent
        if tokens:
            record_work(gw, charge, job, tokens, seconds)
        else:
            s.gateway()[0].settle(proof.key, (), epoch_now(), used=0)
        return ""
    if not tokens:  # the quote stays paid: the same header proves it again, no new transfer
        s.redemptions.release(proof.key)
        return UNUSED
    if record_work(gw, charge, job, tokens, seconds, served) is None:
        return ""
    try:
        _, payouts = s.gateway()
        payout = await payouts.refund(proof.key)
    except KvasirError as exc:
        log.warning("refund not sent", request_id=proof.key, error=str(exc))
        return (
            f" A refund of {format_kvr(proof.amount - served)} KVR is owed to you but "
            f"could not be sent yet ({exc}); the gateway's log has it."
        )
    log.info("paid request refunded", amount=payout.amount, signature=payout.signature)
    return (
        f" {format_kvr(payout.amount)} KVR of your payment (the part not served) was "
        f"refunded to {payout.recipient}: transaction {payout.signature}."
    )


def _measured(settling: Settling, job: Job, tokens: int, seconds: float) -> list[MeasuredWork]:
    """Who did the work of ``job`` and how much, as this node measured it: the generator's
    record of every hop of every choice, or (a generator that ran here alone) this node for
    all of it: each choice computed the prompt and its own tokens."""
    done = [w for r in job.requests() for w in job.generator.work(r.request_id)]
    if done:
        return [MeasuredWork(w.peer, w.units, w.ms_per_token) for w in done]
    positions = job.prompt_positions + tokens
    return [
        MeasuredWork(
            settling.me,
            MeasuredWork.stage_units(positions, settling.layers() + 1),
            1000.0 * seconds / max(tokens, 1),
        )
    ]


def prepaid(gw: Gateway, wallet: str) -> dict[str, Any]:
    """A wallet's prepaid balance at this gateway (what shorter answers left unused)."""
    s = settlement_of(gw)
    if s is None:
        raise BadRequest("this gateway takes no payments ([settlement] is off): requests are free")
    try:
        owner = parse_address(wallet)
    except KvasirError as exc:
        raise BadRequest(str(exc), "wallet") from None
    return {"wallet": str(owner), "prepaid": str(s.payments.deposit_balance(owner))}


def quote(gw: Gateway, max_tokens: int, client: str, prompt_tokens: int = 0) -> dict[str, Any]:
    """A quote for ``client`` (an address: each may ask only so often, each quote is a row)."""
    s = settlement_of(gw)
    if s is None:
        raise BadRequest("this gateway takes no payments ([settlement] is off): requests are free")
    try:
        return s.payments.quote(max_tokens, client, prompt_tokens).to_wire()
    except QuotesTooFrequent as exc:
        raise TooManyRequests(str(exc), code="too_many_quotes") from None
