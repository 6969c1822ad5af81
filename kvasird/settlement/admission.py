"""No work without pay: whether this node does a piece of work for a gateway now, metered.

On a paid network a serving peer (a stage, an expert worker) works for a gateway only while

1. the gateway announces a payout wallet: the wallet's signed link to the gateway's peer
   id, carried in its coverage record (verified when the record was parsed);
2. that wallet holds at least the network's stake minimum of KVR (``NetworkParams.stake_min``,
   set by governance), read from the chain and cached for ``cache_s``. It is a stake *held*,
   not locked by a program: an operator who moves the tokens away is refused from the next
   check on, and nothing is slashed;
3. the receipts it signed to this node and has not paid stay within ``max_unpaid`` (a gateway
   that stops paying claims is cut off once its debt passes the limit);
4. the work this node computed for the wallet and no receipt has covered yet stays within
   its credit (``Meter``).

The meter is the server's own count, in the units receipts pay: positions × layers a stage
computes (the head counting as one layer; prefill, replays and recomputation all count, a
step is charged before it computes), and expert rows × experts a worker computes. It is kept
per payout *wallet*, never per peer id or session: every peer id a wallet links draws on one
account. A receipt counts by what it adds, and only as far as its amount pays for it: the
units it covers are ``min(units, amount × units_per_base_unit)`` of the epoch's cumulative
receipt, so a receipt whose amount did not rise covers nothing beyond what that amount
already paid for, and an old or replayed one is refused by the receipt book before it gets
here. A gateway may run ahead of its receipts by ``credit`` units (the network's
``credit_units``), plus ``TOLERANCE`` of the work its receipts did cover, at most another
credit (its own count and ours differ by failed steps and races: an honest gateway stays
within a few percent); a gateway that falls further behind has less credit left, and at
none the step is refused, naming the gap in units and KVR.

Free, by the operator's choice: the node's own requests, every request when this node runs
with settlement off, and every request on a network whose governance set the price to zero.
The stake and debt checks happen where a session opens (stages) or rows arrive (expert
workers, for each gateway the rows are computed for); the meter at every step and batch of
rows; a refusal's reason reaches the gateway's client. The meter is in memory: a restart of
this node forgives what was outstanding (at most one credit per wallet), which costs the
restarted node, not the network.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from solders.pubkey import Pubkey

from kvasird.settlement.errors import ChainError, SettlementError
from kvasird.settlement.pricing import NetworkParams
from kvasird.settlement.receipts import ReceiptBook
from kvasird.settlement.token import format_kvr
from kvasird.settlement.wallet import WalletLink

PREFIX = "this network's peers serve only staked, paying gateways"
TOLERANCE = 0.05
"""Share of the receipted work a gateway's receipts may fall short of this node's meter by
without drawing on its credit."""


class NotAdmitted(SettlementError):
    """This node does not work for that gateway now; the message says why and what to do."""


@dataclass
class Account:
    """One gateway wallet's work at this node since it started."""

    metered: int = 0
    """Units this node computed (or began computing) for the wallet's gateways."""
    receipted: int = 0
    """Units the wallet's receipts covered, each counted by what it added."""

    def outstanding(self) -> int:
        return self.metered - self.receipted


@dataclass(frozen=True)
class Rates:
    """What a unit of work is worth here, for the meter's messages and the receipts' check."""

    units_per_token: int
    """Units one token costs through the whole model here (layers + head, + experts)."""
    price: int
    """The network's current price, base units per 1000 output tokens."""
    floor: int
    """The lowest price an input token can have, base units per 1000 tokens."""

    def value(self, units: int) -> int:
        """Base units ``units`` of work are worth at the current output price (rounded up)."""
        return -(-units * self.price // (1000 * max(self.units_per_token, 1)))

    def covered(self, units: int, amount: int) -> int:
        """The units a cumulative receipt covers: no more than it says, and no more than its
        amount pays for at a quarter of the floor price (room for the gateway's split, the
        slowest tier and rounding; a receipt with no amount covers nothing)."""
        per_base_unit = 4000 * max(self.units_per_token, 1) // max(self.floor, 1)
        return min(units, amount * max(per_base_unit, 1))


class Admission:
    """The serving side's rule; one per daemon, consulted on every session open, every step
    and every expert request."""

    def __init__(
        self,
        me: str,
        network: str,
        links: Callable[[str], WalletLink | None],
        book: ReceiptBook,
        balance: Callable[[Pubkey], Awaitable[int]],
        params: Callable[[], NetworkParams],
        *,
        max_unpaid: int,
        rates: Callable[[], Rates] | None = None,
        cache_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me, self.network, self.links, self.book = me, network, links, book
        self.balance, self.params, self.max_unpaid = balance, params, max_unpaid
        self.rates = rates or (lambda: Rates(1, params().ceiling, params().floor))
        self.cache_s, self.clock = cache_s, clock
        self._stakes: dict[Pubkey, tuple[float, int]] = {}
        self._passed: dict[str, float] = {}
        """Gateway peer -> when it last passed the stake and debt checks."""
        self.accounts: dict[Pubkey, Account] = {}
        """Payout wallet -> its metered and receipted work here."""
        self.refused = Counter[str]()
        """Refusals per gateway peer (for the status page)."""

    async def check(self, gateway: str, fresh_s: float = 0.0) -> None:
        """Return if this node serves ``gateway`` now; NotAdmitted with the reason otherwise.

        ``fresh_s``: a pass that recent stands. An expert worker asks for every request,
        several a token, and the full check reads the ledger (bench/bench_metering.py
        times it)."""
        params = self.params()
        if gateway == self.me or params.free:
            return
        now = self.clock()
        if now - self._passed.get(gateway, -math.inf) < fresh_s:
            return
        try:
            await self._check(gateway, params, now)
        except NotAdmitted:
            self._refused(gateway)
            self._passed.pop(gateway, None)
            raise
        if len(self._passed) > 4096:
            self._passed.clear()
        self._passed[gateway] = now

    def charge(self, gateway: str, units: int) -> None:
        """Meter ``units`` of work about to be done for ``gateway``, or refuse it (before it
        is computed) when its wallet's credit cannot cover it."""
        params = self.params()
        if units <= 0 or gateway == self.me or params.free:
            return
        link = self.links(gateway)
        if link is None or link.network != self.network:  # refused by check() with the why
            raise NotAdmitted(
                f"{PREFIX}: gateway {gateway} announces no payout wallet on {self.network}"
            )
        account = self.accounts.setdefault(link.wallet, Account())
        allowed = params.credit_units + min(int(TOLERANCE * account.receipted), params.credit_units)
        if account.outstanding() + units > allowed:
            self._refused(gateway)
            rates = self.rates()
            gap = account.outstanding()
            raise NotAdmitted(
                f"{PREFIX}: gateway wallet {link.wallet} has {gap} units of work done here "
                f"(about {format_kvr(rates.value(gap))} KVR) that its receipts do not cover, "
                f"and its credit is {allowed} units: it is served again once its receipts "
                "catch up (a gateway sends them after each request it settles)"
            )
        account.metered += units

    def receipted(self, wallet: Pubkey, before: tuple[int, int], after: tuple[int, int]) -> int:
        """A receipt from ``wallet`` moved its epoch's cumulative (units, amount) from
        ``before`` to ``after``: the units it newly covers (for one whose amount did not rise,
        none beyond what that amount already paid for) come off the wallet's outstanding
        work. Returns them."""
        rates = self.rates()
        added = max(rates.covered(*after) - rates.covered(*before), 0)
        if added:
            self.accounts.setdefault(wallet, Account()).receipted += added
        return added

    def _refused(self, gateway: str) -> None:
        if len(self.refused) > 4096:  # throwaway peer ids must not grow it without bound
            self.refused.clear()
        self.refused[gateway] += 1

    async def _check(self, gateway: str, params: NetworkParams, now: float) -> None:
        link = self.links(gateway)
        if link is None or link.network != self.network:
            raise NotAdmitted(
                f"{PREFIX}: gateway {gateway} announces no payout wallet on "
                f"{self.network}; run it with [settlement] enabled and a wallet "
                f"holding at least {format_kvr(params.stake_min)} KVR"
            )
        stake = await self._stake(link.wallet, now)
        if stake < params.stake_min:
            raise NotAdmitted(
                f"{PREFIX}: gateway wallet {link.wallet} holds "
                f"{format_kvr(stake)} KVR, below the network's stake minimum of "
                f"{format_kvr(params.stake_min)} KVR (held in the wallet, "
                "checked on chain)"
            )
        unpaid = self.book.unpaid(link.wallet)
        if unpaid > self.max_unpaid:
            raise NotAdmitted(
                f"{PREFIX}: gateway wallet {link.wallet} owes this node "
                f"{format_kvr(unpaid)} KVR in unpaid receipts, over its limit of "
                f"{format_kvr(self.max_unpaid)} KVR; it is served again once it "
                "pays this node's claims"
            )

    async def _stake(self, wallet: Pubkey, now: float) -> int:
        """The KVR ``wallet`` holds, from the chain at most ``cache_s`` ago."""
        cached = self._stakes.get(wallet)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        try:
            stake = await self.balance(wallet)
        except ChainError as exc:
            raise NotAdmitted(
                f"{PREFIX}: the stake of gateway wallet {wallet} cannot be "
                f"read from the chain now ({exc}); retry shortly"
            ) from None
        if len(self._stakes) > 4096:
            self._stakes.clear()
        self._stakes[wallet] = (now, stake)
        return stake
