"""No work without pay: whether this node serves a gateway's sessions now.

On a paid network a serving peer (a stage, an expert worker) works for a gateway only while

1. the gateway announces a payout wallet: the wallet's signed link to the gateway's peer
   id, carried in its coverage record (verified when the record was parsed);
2. that wallet holds at least the network's stake minimum of KVR (``NetworkParams.stake_min``,
   set by governance), read from the chain and cached for ``cache_s``. It is a stake *held*,
   not locked by a program: an operator who moves the tokens away is refused from the next
   check on, and nothing is slashed;
3. the receipts it signed to this node and has not paid stay within ``max_unpaid`` (a gateway
   that stops paying claims is cut off once its debt passes the limit);
4. it has not opened more than ``max_unreceipted`` sessions here since its last receipt (a
   gateway that sends no receipts at all is cut off after that many).

Free, by the operator's choice: the node's own requests, every request when this node runs
with settlement off, and every request on a network whose governance set the price to zero.
The checks happen where a session opens (stages) or rows arrive (expert workers, for each
gateway the rows are computed for); a refusal's reason reaches the gateway's client.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from solders.pubkey import Pubkey

from kvasird.settlement.errors import ChainError, SettlementError
from kvasird.settlement.pricing import NetworkParams
from kvasird.settlement.receipts import ReceiptBook
from kvasird.settlement.token import format_kvr
from kvasird.settlement.wallet import WalletLink

PREFIX = "this network's peers serve only staked, paying gateways"


class NotAdmitted(SettlementError):
    """This node does not work for that gateway now; the message says why and what to do."""


class Admission:
    """The serving side's rule; one per daemon, consulted on every session open and expert
    request."""

    def __init__(self, me: str, network: str, links: Callable[[str], WalletLink | None],
                 book: ReceiptBook, balance: Callable[[Pubkey], Awaitable[int]],
                 params: Callable[[], NetworkParams], *, max_unpaid: int, max_unreceipted: int,
                 cache_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.me, self.network, self.links, self.book = me, network, links, book
        self.balance, self.params = balance, params
        self.max_unpaid, self.max_unreceipted = max_unpaid, max_unreceipted
        self.cache_s, self.clock = cache_s, clock
        self._stakes: dict[Pubkey, tuple[float, int]] = {}
        self._passed: dict[str, float] = {}
        """Gateway peer -> when it last passed every check."""
        self.unreceipted = Counter[str]()
        """Sessions opened here per gateway peer since its last receipt."""
        self.refused = Counter[str]()
        """Refusals per gateway peer (for the status page)."""

    async def check(self, gateway: str, fresh_s: float = 0.0) -> None:
        """Return if this node serves ``gateway`` now; NotAdmitted with the reason otherwise.

        ``fresh_s``: a pass that recent stands. An expert worker asks for every request,
        several a token, and the full check reads the ledger (16 us measured)."""
        params = self.params()
        if gateway == self.me or params.free:
            return
        now = self.clock()
        if now - self._passed.get(gateway, -math.inf) < fresh_s:
            return
        try:
            await self._check(gateway, params, now)
        except NotAdmitted:
            self.refused[gateway] += 1
            self._passed.pop(gateway, None)
            raise
        if len(self._passed) > 4096:
            self._passed.clear()
        self._passed[gateway] = now

    def opened(self, gateway: str) -> None:
        """A session of ``gateway`` opened here: one more to be covered by a receipt."""
        if gateway != self.me:
            self.unreceipted[gateway] += 1

    def receipted(self, gateway: str) -> None:
        """A newer receipt from ``gateway`` arrived: its sessions so far are accounted for."""
        self.unreceipted.pop(gateway, None)

    async def _check(self, gateway: str, params: NetworkParams, now: float) -> None:
        link = self.links(gateway)
        if link is None or link.network != self.network:
            raise NotAdmitted(f"{PREFIX}: gateway {gateway} announces no payout wallet on "
                              f"{self.network}; run it with [settlement] enabled and a wallet "
                              f"holding at least {format_kvr(params.stake_min)} KVR")
        stake = await self._stake(link.wallet, now)
        if stake < params.stake_min:
            raise NotAdmitted(f"{PREFIX}: gateway wallet {link.wallet} holds "
                              f"{format_kvr(stake)} KVR, below the network's stake minimum of "
                              f"{format_kvr(params.stake_min)} KVR (held in the wallet, "
                              "checked on chain)")
        unpaid = self.book.unpaid(link.wallet)
        if unpaid > self.max_unpaid:
            raise NotAdmitted(f"{PREFIX}: gateway wallet {link.wallet} owes this node "
                              f"{format_kvr(unpaid)} KVR in unpaid receipts, over its limit of "
                              f"{format_kvr(self.max_unpaid)} KVR; it is served again once it "
                              "pays this node's claims")
        if self.unreceipted[gateway] >= self.max_unreceipted:
            raise NotAdmitted(f"{PREFIX}: gateway {gateway} opened {self.unreceipted[gateway]} "
                              "sessions here without sending a receipt for them")

    async def _stake(self, wallet: Pubkey, now: float) -> int:
        """The KVR ``wallet`` holds, from the chain at most ``cache_s`` ago."""
        cached = self._stakes.get(wallet)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        try:
            stake = await self.balance(wallet)
        except ChainError as exc:
            raise NotAdmitted(f"{PREFIX}: the stake of gateway wallet {wallet} cannot be "
                              f"read from the chain now ({exc}); retry shortly") from None
        if len(self._stakes) > 4096:
            self._stakes.clear()
        self._stakes[wallet] = (now, stake)
        return stake
