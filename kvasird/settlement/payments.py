"""Quote → payment → inference, and prepaid deposits.

A quote gives the consumer a private request id and a public payment reference (a
hash of the id) to put in the transfer's memo. Settling a quote checks the chain
(see ``verify``) and consumes the signature in the same SQLite transaction that marks
the quote paid; the UNIQUE key on used signatures, not a prior lookup, is what makes a
signature pay once. Settling an already-paid quote again returns the same proof.
Deposits credit a wallet's prepaid balance and additionally require sender binding.

Anyone may ask for a quote, so quotes are bounded twice: each network client has a
token bucket (``QuoteLimiter``), and every new quote deletes a batch of open quotes
that expired more than ``QUOTE_GRACE_S`` ago. Only open (never paid) quotes are
deleted; a paid, settled, failed or refunded quote is a money record and stays.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from solders.pubkey import Pubkey
from solders.signature import Signature

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import (
    PaymentRejected,
    QuoteError,
    QuotesTooFrequent,
    SignatureAlreadyUsed,
)
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.pricing import PriceController
from kvasird.settlement.verify import check_payment, debited_owners

QUOTE_BURST = 10
"""Quotes one client may ask for at once: a consumer quoting a few requests ahead is fine."""
QUOTE_REFILL_PER_S = 1.0
"""Quotes per second a client earns back; sustained, one quote a second per address."""
MAX_TRACKED_CLIENTS = 10_000
"""Buckets kept in memory; the least recently seen client is forgotten (it starts full again)."""
QUOTE_GRACE_S = 600.0
"""How long an expired open quote is kept, so paying it late says "expired", not "unknown"."""
QUOTE_SWEEP_BATCH = 100
"""Expired open quotes deleted per new quote: bounded work, yet faster than one per quote."""


def payment_reference(request_id: str) -> str:
    """The public memo for a private request id (the id cannot be recovered from it)."""
    return "kvasir:" + hashlib.sha256(b"kvasir-quote-v1\n" + request_id.encode()).hexdigest()[:40]


def prepaid_message(request_id: str) -> bytes:
    """What a wallet signs to pay the quote ``request_id`` from its prepaid balance (the id is
    secret between the consumer and the gateway: the signature pays that quote only)."""
    return b"kvasir-prepaid-v1\n" + request_id.encode()


@dataclass(frozen=True)
class Quote:
    """A price offer for one request; ``request_id`` is a secret between consumer and gateway."""

    request_id: str
    """Private id; whoever holds it can use the paid request, so it is never published."""
    reference: str
    """Public payment reference the transfer must carry as its memo."""
    amount: int
    """Base units of KVR due."""
    max_tokens: int
    """Output tokens this quote covers (all choices together)."""
    price: int
    """Output price used, base units per 1000 tokens."""
    prompt_tokens: int
    """Prompt tokens this quote covers (each choice computes the prompt)."""
    input_price: int
    """Input price used, base units per 1000 tokens."""
    vault: Pubkey
    """Owner of the vault token account to pay (the gateway's wallet)."""
    mint: Pubkey
    """KVR mint."""
    expires_at: float
    """Unix time after which the quote is no longer honoured."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "memo": self.reference,
            "amount": str(self.amount),
            "max_tokens": self.max_tokens,
            "prompt_tokens": self.prompt_tokens,
            "price_per_1k_tokens": str(self.price),
            "price_per_1k_output_tokens": str(self.price),
            "price_per_1k_input_tokens": str(self.input_price),
            "vault": str(self.vault),
            "mint": str(self.mint),
            "expires_at": self.expires_at,
        }


@dataclass(frozen=True)
class PaymentProof:
    """A payment the chain proved and the ledger consumed."""

    key: str
    """The request id (quote) or the credited wallet (deposit)."""
    signature: str
    """The consumed transaction signature."""
    amount: int
    """Base units credited."""
    payer: str
    """Wallet whose tokens moved (refunds go back to it)."""


@dataclass(frozen=True)
class Coverage:
    """What a paid quote covers, at its own prices (the price floats; a quote does not)."""

    amount: int
    """Base units paid."""
    prompt_tokens: int
    """Prompt tokens it was quoted for."""
    max_tokens: int
    """Output tokens it was quoted for."""
    input_price: int
    """Base units per 1000 input tokens."""
    price: int
    """Base units per 1000 output tokens."""

    def cost(self, prompt_tokens: int, output_tokens: int) -> int:
        """What ``prompt_tokens`` in and ``output_tokens`` out cost at this quote's prices."""
        return -(-(self.input_price * prompt_tokens + self.price * output_tokens) // 1000)


def _insert(db: sqlite3.Connection, quote: Quote, state: str, payer: str) -> None:
    db.execute(
        "INSERT INTO settlement_quotes (request_id, memo, amount, max_tokens, price, "
        "prompt_tokens, input_price, expires_at, payer, state) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            quote.request_id,
            quote.reference,
            quote.amount,
            quote.max_tokens,
            quote.price,
            quote.prompt_tokens,
            quote.input_price,
            quote.expires_at,
            payer or None,
            state,
        ),
    )


class QuoteLimiter:
    """A token bucket per client address, in memory (a restart forgives everyone; that is fine)."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        burst: int = QUOTE_BURST,
        refill_per_s: float = QUOTE_REFILL_PER_S,
        max_clients: int = MAX_TRACKED_CLIENTS,
    ) -> None:
        self._clock = clock
        self._burst = float(burst)
        self._refill = refill_per_s
        self._max_clients = max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """client -> (tokens left, when counted), least recently seen first."""

    @property
    def tracked(self) -> int:
        return len(self._buckets)

    def take(self, client: str) -> None:
        """Spend one quote of ``client``'s allowance, or raise QuotesTooFrequent."""
        now = self._clock()
        tokens, at = self._buckets.pop(client, (self._burst, now))
        tokens = min(self._burst, tokens + max(0.0, now - at) * self._refill)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            raise QuotesTooFrequent(client, math.ceil((1.0 - tokens) / self._refill))
        self._buckets[client] = (tokens - 1.0, now)
        while len(self._buckets) > self._max_clients:
            self._buckets.popitem(last=False)


class Payments:
    def __init__(
        self,
        ledger: Ledger,
        chain: ChainClient,
        *,
        vault: Pubkey,
        mint: Pubkey,
        prices: PriceController,
        locks: KeyedLocks,
        quote_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ledger = ledger
        self._chain = chain
        self.vault = vault
        self.mint = mint
        self._prices = prices
        self._locks = locks
        self._ttl = quote_ttl_s
        self._clock = clock
        self._limiter = QuoteLimiter(clock)

    def quote(self, max_tokens: int, client: str = "", prompt_tokens: int = 0) -> Quote:
        """A new quote for ``client`` (its network address; "" for in-process callers,
        which are not rate-limited) covering ``prompt_tokens`` in and ``max_tokens`` out.
        Also deletes a batch of long-expired open quotes."""
        if not 0 < max_tokens <= 1_000_000:
            raise QuoteError(f"max_tokens {max_tokens} out of range: ask for 1..1000000 tokens")
        if not 0 <= prompt_tokens <= 10_000_000:
            raise QuoteError(f"prompt_tokens {prompt_tokens} out of range: 0..10000000")
        if client:
            self._limiter.take(client)
        quote = self._new_quote(max_tokens, prompt_tokens)
        with self._ledger.transaction() as db:
            db.execute(
                "DELETE FROM settlement_quotes WHERE rowid IN (SELECT rowid FROM "
                "settlement_quotes WHERE state = 'open' AND expires_at < ? LIMIT ?)",
                (self._clock() - QUOTE_GRACE_S, QUOTE_SWEEP_BATCH),
            )
            _insert(db, quote, "open", "")
        return quote

    def operator_quote(self, max_tokens: int, prompt_tokens: int) -> Quote:
        """A request of the operator's own, paid by the vault itself: a quote recorded as
        paid with the vault as payer, settled and receipted to the peers like any other
        (``Rewards.settle`` charges what it used)."""
        quote = self._new_quote(max_tokens, prompt_tokens)
        with self._ledger.transaction() as db:
            _insert(db, quote, "paid", str(self.vault))
        return quote

    def _new_quote(self, max_tokens: int, prompt_tokens: int) -> Quote:
        request_id = secrets.token_urlsafe(24)
        p = self._prices
        return Quote(
            request_id,
            payment_reference(request_id),
            p.amount_for(max_tokens, prompt_tokens),
            max_tokens,
            p.price,
            prompt_tokens,
            p.input_price,
            self.vault,
            self.mint,
            self._clock() + self._ttl,
        )

    def coverage(self, request_id: str) -> Coverage | None:
        """What a quote pays for, at the prices it was made at (None: unknown)."""
        row = self._ledger.one(
            "SELECT amount, prompt_tokens, max_tokens, input_price, price "
            "FROM settlement_quotes WHERE request_id = ?",
            request_id,
        )
        return Coverage(*row) if row else None

    def quoted_tokens(self, request_id: str) -> int:
        """Output tokens a quote covers (0 for an unknown request id)."""
        c = self.coverage(request_id)
        return c.max_tokens if c is not None else 0

    def quote_of(self, reference: str) -> Quote | None:
        """The quote whose public payment reference is ``reference`` (None: unknown)."""
        row = self._ledger.one(
            "SELECT request_id, memo, amount, max_tokens, price, prompt_tokens, input_price, "
            "expires_at FROM settlement_quotes WHERE memo = ?",
            reference,
        )
        if row is None:
            return None
        request_id, memo, amount, max_tokens, price, prompt_tokens, input_price, expires = row
        return Quote(
            request_id,
            memo,
            amount,
            max_tokens,
            price,
            prompt_tokens,
            input_price,
            self.vault,
            self.mint,
            expires,
        )

    async def settle_quote(
        self,
        request_id: str,
        signature: Signature,
        submit: Callable[[], Awaitable[None]] | None = None,
    ) -> PaymentProof:
        """Prove that ``signature`` paid quote ``request_id``; idempotent for a paid quote.
        ``submit`` lands the transaction first, under the quote's lock, while the quote is
        open and unexpired (x402: the gateway submits the payment itself, once)."""
        async with self._locks.hold(f"quote:{request_id}"):
            row = self._ledger.one(
                "SELECT memo, amount, expires_at, state, signature, payer "
                "FROM settlement_quotes WHERE request_id = ?",
                request_id,
            )
            if row is None:
                raise QuoteError("unknown request id: ask for a new quote")
            memo, amount, expires_at, state, paid_sig, payer = row
            if state != "open":
                return PaymentProof(request_id, paid_sig or "", amount, payer or "")
            if self._clock() > expires_at:
                raise QuoteError(f"quote {memo} expired: ask for a new quote")
            if submit is not None:
                await submit()
            tx = await self._chain.transaction(signature)
            check_payment(
                tx,
                signature=str(signature),
                vault_owner=self.vault,
                mint=self.mint,
                amount=amount,
                memo=memo.encode(),
            )
            assert tx is not None
            payer = str((debited_owners(tx, self.mint) or [tx.fee_payer])[0])
            with self._ledger.transaction() as db:
                self._consume(db, signature, "quote", request_id, amount)
                db.execute(
                    "UPDATE settlement_quotes SET state = 'paid', signature = ?, payer = ? "
                    "WHERE request_id = ?",
                    (str(signature), payer, request_id),
                )
            return PaymentProof(request_id, str(signature), amount, payer)

    async def deposit(self, owner: Pubkey, signature: Signature, amount: int) -> PaymentProof:
        """Credit ``amount`` to ``owner``'s prepaid balance if ``owner`` sent it to the vault."""
        if amount <= 0:
            raise PaymentRejected("deposit amount must be positive")
        async with self._locks.hold(f"wallet:{owner}"):
            tx = await self._chain.transaction(signature)
            check_payment(
                tx,
                signature=str(signature),
                vault_owner=self.vault,
                mint=self.mint,
                amount=amount,
                owner=owner,
            )
            with self._ledger.transaction() as db:
                self._consume(db, signature, "deposit", str(owner), amount)
                db.execute(
                    "INSERT INTO settlement_deposits VALUES (?, ?) ON CONFLICT (owner) "
                    "DO UPDATE SET balance = balance + excluded.balance",
                    (str(owner), amount),
                )
            return PaymentProof(str(owner), str(signature), amount, str(owner))

    async def pay_quote_from_deposit(self, owner: Pubkey, request_id: str) -> PaymentProof:
        """Use ``owner``'s prepaid balance for a quote (the caller authenticated ``owner``)."""
        async with self._locks.hold(f"wallet:{owner}"), self._locks.hold(f"quote:{request_id}"):
            row = self._ledger.one(
                "SELECT amount, state, payer FROM settlement_quotes WHERE request_id = ?",
                request_id,
            )
            if row is not None and row[1] == "paid" and row[2] == str(owner):  # asked again
                return PaymentProof(request_id, "", row[0], str(owner))
            if row is None or row[1] != "open":
                raise QuoteError("unknown or already settled request id: ask for a new quote")
            amount = row[0]
            with self._ledger.transaction() as db:
                updated = db.execute(
                    "UPDATE settlement_deposits SET balance = balance - ? "
                    "WHERE owner = ? AND balance >= ?",
                    (amount, str(owner), amount),
                )
                if updated.rowcount != 1:
                    raise PaymentRejected(
                        f"prepaid balance of {owner} is below {amount}: deposit more"
                    )
                db.execute(
                    "UPDATE settlement_quotes SET state = 'paid', payer = ? WHERE request_id = ?",
                    (str(owner), request_id),
                )
            return PaymentProof(request_id, "", amount, str(owner))

    def deposit_balance(self, owner: Pubkey) -> int:
        return self._ledger.value(
            "SELECT balance FROM settlement_deposits WHERE owner = ?", str(owner)
        )

    @staticmethod
    def _consume(
        db: sqlite3.Connection, signature: Signature, purpose: str, key: str, amount: int
    ) -> None:
        try:
            db.execute(
                "INSERT INTO settlement_used_signatures VALUES (?, ?, ?, ?)",
                (str(signature), purpose, key, amount),
            )
        except sqlite3.IntegrityError:
            raise SignatureAlreadyUsed(
                f"transaction {signature} was already used for a payment: "
                "each transfer pays once; send a new one"
            ) from None
