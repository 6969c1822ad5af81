"""Receipts and claims between peers, over libp2p: the protocol "/kvasir/settle/1".

    gateway ──ReceiptDelivery {op, receipt}──▶ peer
            ◀── Noted {} ──                      ReceiptBook.accept: signed by the gateway's
                                                 wallet, newer than the one held; the peer
                                                 notes the peer id that wallet speaks from
    peer ──Claim {op, link}──▶ gateway          Settlement.claim: pays the peer's linked
            ◀── Paid {signature, amount} ──      wallet on chain (pending record first, under
                                                 the peer's lock), then debits
    peer                                         ReceiptBook.verify_payout: counts the payout
                                                 only once the chain shows it

Gateway side: once a paid request is settled, ``deliver`` queues each peer that worked on
it; a background task sends each its new cumulative receipt for the epoch (a peer that
misses one is made whole by the next: receipts are cumulative). Peer side: ``claim_all``
claims from every gateway whose receipts are unpaid (``kvasird wallet claim``, and by
itself once a gateway owes ``claim_threshold``). A receipt is also what lets a gateway keep
being served (``Admission``): the work it covers comes off the wallet's meter here.

Who is who comes from libp2p: the caller of a request is the authenticated peer at the
other end; a receipt's gateway wallet must be the wallet that peer links in its record.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from solders.pubkey import Pubkey
from solders.signature import Signature

from kvasird.errors import KvasirError, WireError
from kvasird.logs import get_logger
from kvasird.settlement.errors import ClaimError, ReceiptRejected
from kvasird.settlement.receipts import Receipt
from kvasird.settlement.wallet import WalletLink
from kvasird.wire import schema
from kvasird.wire.protocols import OP, SETTLE_PROTOCOL

if TYPE_CHECKING:
    from kvasird.settlement.admission import Admission
    from kvasird.settlement.service import Settlement

RECEIPT_TIMEOUT_S = 10.0
CLAIM_TIMEOUT_S = 90.0
"""A claim waits for the gateway's payout to reach the required commitment."""
EPOCH_S = 3600
"""Receipts accumulate per hour (an epoch) of the gateway's clock."""
log = get_logger("kvasird.settlement.exchange")

Request = Callable[[str, str, dict[str, Any], float], Awaitable[dict[str, Any]]]
"""(peer, protocol, message, timeout) -> the peer's reply (the node's stream channels)."""


def epoch_now() -> int:
    return int(time.time() // EPOCH_S)


@dataclass(frozen=True)
class ReceiptDelivery:
    """A gateway's new cumulative receipt for the peer it sends it to."""

    receipt: Receipt
    """Signed by the gateway's wallet (its signature checked on parsing)."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "receipt", "receipt": self.receipt.to_wire()}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> ReceiptDelivery:
        return ReceiptDelivery(
            Receipt.from_wire(schema.mapping(d.get("receipt"), "settle.receipt"))
        )


@dataclass(frozen=True)
class Noted:
    """The peer took a receipt (the answer carries nothing else)."""

    def to_wire(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def from_wire(d: Any) -> Noted:
        schema.mapping(d, "settle.noted")
        return Noted()


@dataclass(frozen=True)
class Claim:
    """A peer asks a gateway to pay what its receipts say it earned."""

    terms: dict[str, Any]
    """What the claim names, as sent: only the peer's wallet link, which the gateway
    verifies against the caller (Settlement.claim); a claim naming anything else (units,
    an amount) is refused there, whole."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "claim", **self.terms}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Claim:
        schema.mapping(d.get("link"), "settle.claim.link")
        return Claim({k: v for k, v in d.items() if k not in ("id", OP)})


@dataclass(frozen=True)
class Paid:
    """The gateway's answer to a claim: the payout it sent on chain."""

    signature: str
    """The payout transaction (the peer checks it on chain before counting it)."""
    amount: int
    """Base units paid."""

    def to_wire(self) -> dict[str, Any]:
        return {"signature": self.signature, "amount": self.amount}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Paid:
        return Paid(
            schema.text(d, "signature", 100, "settle.paid"),
            schema.integer(d, "amount", 0, 1 << 63, "settle.paid"),
        )


_PARSERS: dict[str, Callable[[dict[str, Any]], ReceiptDelivery | Claim]] = {
    "receipt": ReceiptDelivery.from_wire,
    "claim": Claim.from_wire,
}


def parse(d: dict[str, Any]) -> ReceiptDelivery | Claim:
    """The request a decoded settle frame holds, validated (WireError naming the field)."""
    op = d.get(OP)
    parser = _PARSERS.get(op) if isinstance(op, str) else None
    if parser is None:
        raise WireError(f"settle: unknown op {op!r:.40}")
    return parser(d)


@dataclass(frozen=True)
class Claimed:
    """One gateway's answer to a claim, as this peer verified it on chain."""

    gateway: str
    """The gateway's wallet."""
    peer_id: str
    """The gateway's peer id."""
    amount: int
    """Base units the chain shows arrived in this node's wallet ("" signature: none)."""
    signature: str
    """The payout transaction, or "" when the claim failed."""
    error: str = ""
    """Why the claim failed, when it did."""

    def to_json(self) -> dict[str, Any]:
        return {
            "gateway": self.gateway,
            "peer_id": self.peer_id,
            "amount": self.amount,
            "signature": self.signature,
            "error": self.error,
        }


class Exchange:
    """This node's side of receipts and claims, as a gateway and as a serving peer."""

    def __init__(
        self,
        settlement: Settlement,
        me: str,
        request: Request,
        links: Callable[[str], WalletLink | None],
        admission: Admission,
        *,
        claim_threshold: int,
    ) -> None:
        self.s, self.me, self.request, self.links = settlement, me, request, links
        self.admission, self.claim_threshold = admission, claim_threshold
        self._due_send, self._due = trio.open_memory_channel[tuple[str, int]](4096)
        self._claiming = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self.delivered = 0
        """Receipts delivered (and accepted) since start."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.s.rewards is not None:  # only a node holding its keypair pays peers
                nursery.start_soon(self._deliver_loop)
            task_status.started()

    # --- gateway side ------------------------------------------------------------------

    def deliver(self, peers: list[str], epoch: int) -> None:
        """Queue a fresh receipt for each peer (sent in the background, never blocking)."""
        for peer in peers:
            if peer != self.me:
                try:
                    self._due_send.send_nowait((peer, epoch))
                except trio.WouldBlock:
                    log.warning("receipt queue full: the next receipt makes up for it", peer=peer)

    async def _deliver_loop(self) -> None:
        rewards, _ = self.s.gateway()
        while True:
            peer, epoch = await self._due.receive()
            pending = {(peer, epoch)}
            while True:  # coalesce: one receipt per peer and epoch carries all work so far
                try:
                    pending.add(self._due.receive_nowait())
                except trio.WouldBlock:
                    break
            for p, e in pending:
                msg = ReceiptDelivery(rewards.receipt(p, e)).to_wire()
                try:
                    Noted.from_wire(await self.request(p, SETTLE_PROTOCOL, msg, RECEIPT_TIMEOUT_S))
                    self.delivered += 1
                except KvasirError as exc:
                    log.info(
                        "receipt not delivered (the next one makes up for it)",
                        peer=p,
                        reason=str(exc)[:200],
                    )

    async def _claimed(self, caller: str, claim: Claim) -> Paid:
        payout = await self.s.claim(caller, claim.terms)
        log.info("claim paid", peer=caller, amount=payout.amount, signature=payout.signature)
        return Paid(payout.signature, payout.amount)

    # --- serving peer side -------------------------------------------------------------

    def _accept_receipt(self, caller: str, delivery: ReceiptDelivery) -> Noted:
        link, signed = self.links(caller), delivery.receipt
        if link is None or link.wallet != signed.gateway:
            raise ReceiptRejected(
                f"receipt signed by {signed.gateway} came from {caller}, "
                "whose record links another wallet (or none): ignored"
            )
        before = self.s.receipts.held(signed.gateway, signed.epoch)
        receipt = self.s.receipts.accept(signed.to_wire())
        self.s.receipts.remember_gateway(receipt.gateway, caller)
        self.admission.receipted(receipt.gateway, before, (receipt.units, receipt.amount))
        if (
            0 < self.claim_threshold <= self.s.receipts.unpaid(receipt.gateway)
            and self._nursery is not None
        ):
            self._nursery.start_soon(self.claim_all)
        return Noted()

    async def claim_all(self) -> list[Claimed]:
        """Claim from every gateway that owes this node, verifying each payout on chain."""
        link = self.s.link
        if link is None:
            raise ClaimError(
                "this node holds no wallet keypair to sign its claims with: set "
                "[settlement] wallet to a keypair file"
            )
        async with self._claiming:
            out = []
            for gateway, peer_id, unpaid in self.s.receipts.gateways():
                if unpaid > 0 and peer_id != self.me:
                    out.append(await self._claim_one(gateway, peer_id, link))
            return out

    async def _claim_one(self, gateway: Pubkey, peer_id: str, link: WalletLink) -> Claimed:
        try:
            reply = await self.request(
                peer_id, SETTLE_PROTOCOL, Claim({"link": link.to_wire()}).to_wire(), CLAIM_TIMEOUT_S
            )
            signature = Signature.from_string(Paid.from_wire(reply).signature)
            got = await self.s.receipts.verify_payout(
                self.s.chain, gateway, link.wallet, self.s.mint, signature
            )
        except (KvasirError, ValueError) as exc:
            log.warning("claim failed", gateway=str(gateway), peer=peer_id, error=str(exc)[:300])
            return Claimed(str(gateway), peer_id, 0, "", str(exc)[:300])
        log.info("claim paid out", gateway=str(gateway), amount=got, signature=str(signature))
        return Claimed(str(gateway), peer_id, got, str(signature))

    # --- the protocol --------------------------------------------------------------------

    async def handle(self, caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        request = parse(msg)
        if isinstance(request, ReceiptDelivery):
            return self._accept_receipt(caller, request).to_wire()
        return (await self._claimed(caller, request)).to_wire()
