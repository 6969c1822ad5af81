"""Errors of the settlement subsystem.

KvasirError
└── SettlementError              anything settlement refuses; str() says what to do
    ├── ChainError               the RPC endpoint failed, refused a transaction, or timed out
    │   └── ChainRefused         it answered with an error: the transaction was not accepted
    ├── WalletError              a keypair file is missing, malformed, or only an address is held
    ├── PaymentRejected          the chain does not prove what a payment claims (never credited)
    │   └── SignatureAlreadyUsed the transaction signature was consumed by an earlier credit
    ├── QuoteError               the quote is unknown, expired, or already settled differently
    │   └── QuotesTooFrequent    one client asked for quotes faster than the rate limit allows
    ├── ClaimError               nothing to claim, or a payout failed (the balance stays intact)
    ├── ReceiptRejected          a receipt is not signed by the gateway it names, or goes backwards
    ├── GovernanceRejected       governance message not signed by the genesis wallet, or stale
    ├── AdminAuthError           wallet sign-in or TOTP failed
    │   └── TotpAlreadyEnrolled  a TOTP secret exists; enrolling again would hand out a new one
    └── NotAdmitted              (admission.py) this node does not work for that gateway now

The whole tree of kvasird's errors is drawn in kvasird/errors.py (and checked by a test).
"""

from __future__ import annotations

from kvasird.errors import KvasirError


class SettlementError(KvasirError):
    """Base of every settlement refusal."""


class ChainError(SettlementError):
    """The chain (RPC endpoint) failed or refused; nothing was credited or debited."""


class ChainRefused(ChainError):
    """The RPC endpoint answered with an error: the request (or transaction) was not accepted."""


class WalletError(SettlementError):
    """The operator wallet cannot be used for what was asked."""


class PaymentRejected(SettlementError):
    """The transaction does not prove the payment; the message says which check failed."""


class SignatureAlreadyUsed(PaymentRejected):
    """This signature already paid for something; a signature is consumed once."""


class QuoteError(SettlementError):
    """The quote cannot be paid: unknown request id, expired, or settled by another signature."""


class QuotesTooFrequent(QuoteError):
    """A client used up its quote allowance; it gets a new quote after ``wait_s`` seconds."""

    def __init__(self, client: str, wait_s: int) -> None:
        super().__init__(f"too many quotes from {client}: wait {wait_s} s")
        self.client = client
        """The address that asked too often."""
        self.wait_s = wait_s
        """Whole seconds until the next quote is allowed."""


class ClaimError(SettlementError):
    """A claim cannot be paid; no money moved and the balance is unchanged."""


class ReceiptRejected(SettlementError):
    """A receipt failed its signature or monotonicity check."""


class GovernanceRejected(SettlementError):
    """A governance message was not applied; network parameters are unchanged."""


class AdminAuthError(SettlementError):
    """Admin sign-in failed; sign a fresh nonce with the operator wallet and use a new TOTP code."""


class TotpAlreadyEnrolled(AdminAuthError):
    """TOTP is enrolled already; a second secret is never issued (whoever asked may not be you)."""
