"""Operator admin sign-in: a Sign-In-With-Solana message signed by the operator wallet, plus TOTP.

    challenge()  → a SIWS-style message with domain, address, a single-use nonce, expiry
    sign_in()    ← that message, the wallet's signature, a TOTP code → a session token

The nonce is consumed and the TOTP time step recorded in one SQLite transaction, so
neither a signed message nor a TOTP code works twice (pyotp alone accepts a code
again within its window). Session tokens are random; only their hashes are stored,
and comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import pyotp
from solders.pubkey import Pubkey
from solders.signature import Signature

from kvasird.settlement.errors import AdminAuthError
from kvasird.settlement.ledger import Ledger

NONCE_TTL_S = 300.0
SESSION_TTL_S = 3600.0
_TOTP_WINDOW = 1


@dataclass(frozen=True)
class SignInChallenge:
    """What the operator's wallet is asked to sign."""

    message: str
    """The SIWS text; sign its UTF-8 bytes."""
    nonce: str
    """Single-use server nonce embedded in the message."""
    expires_at: float
    """Unix time after which the message is refused."""


class AdminAuth:
    def __init__(
        self, ledger: Ledger, operator: Pubkey, domain: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._ledger = ledger
        self._operator = operator
        self._domain = domain
        self._clock = clock

    def enroll_totp(self) -> str:
        """Create (or replace) the TOTP secret; returns the otpauth:// URI for an authenticator."""
        secret = pyotp.random_base32()
        with self._ledger.transaction() as db:
            db.execute("INSERT OR REPLACE INTO settlement_admin_totp VALUES (1, ?, -1)", (secret,))
        return pyotp.TOTP(secret).provisioning_uri(name=str(self._operator), issuer_name="kvasird")

    def challenge(self) -> SignInChallenge:
        now = self._clock()
        nonce = secrets.token_hex(16)
        expires = now + NONCE_TTL_S
        message = (
            f"{self._domain} wants you to sign in with your Solana account:\n{self._operator}\n\n"
            f"Sign in to administer this kvasird node.\n\nVersion: 1\nNonce: {nonce}\n"
            f"Issued At: {_iso(now)}\nExpiration Time: {_iso(expires)}"
        )
        with self._ledger.transaction() as db:
            db.execute("DELETE FROM settlement_admin_nonces WHERE expires_at < ?", (now,))
            db.execute("INSERT INTO settlement_admin_nonces VALUES (?, ?)", (nonce, expires))
        return SignInChallenge(message, nonce, expires)

    def sign_in(self, message: str, signature: Signature, totp_code: str) -> str:
        """Verify wallet signature + TOTP; returns a session token. Nonces and codes work once."""
        fields = _fields(message)
        if not message.startswith(f"{self._domain} wants you to sign in") or fields.get(
            "address"
        ) != str(self._operator):
            raise AdminAuthError(
                f"sign-in message is not for {self._domain} and operator {self._operator}"
            )
        if not signature.verify(self._operator, message.encode()):
            raise AdminAuthError("signature does not verify against the operator wallet")
        now = self._clock()
        with self._ledger.transaction() as db:
            gone = db.execute(
                "DELETE FROM settlement_admin_nonces WHERE nonce = ? AND expires_at >= ?",
                (fields.get("Nonce", ""), now),
            )
            if gone.rowcount != 1:
                raise AdminAuthError("nonce unknown, used or expired: request a new challenge")
            self._consume_totp(db, totp_code, now)
            token = secrets.token_urlsafe(32)
            db.execute(
                "INSERT INTO settlement_admin_sessions VALUES (?, ?)",
                (_hash(token), now + SESSION_TTL_S),
            )
        return token

    def session_valid(self, token: str) -> bool:
        wanted = _hash(token)
        row = self._ledger.one(
            "SELECT token_hash, expires_at FROM settlement_admin_sessions WHERE token_hash = ?",
            wanted,
        )
        return row is not None and hmac.compare_digest(row[0], wanted) and row[1] >= self._clock()

    def _consume_totp(self, db: sqlite3.Connection, code: str, now: float) -> None:
        row = db.execute(
            "SELECT secret, last_step FROM settlement_admin_totp WHERE id = 1"
        ).fetchone()
        if row is None:
            raise AdminAuthError("TOTP is not enrolled: run the admin TOTP enrolment first")
        totp = pyotp.TOTP(row[0])
        step = int(now // totp.interval)
        matched = [
            s
            for s in range(step - _TOTP_WINDOW, step + _TOTP_WINDOW + 1)
            if hmac.compare_digest(totp.at(s * totp.interval), code.strip())
        ]
        if not matched:
            raise AdminAuthError("TOTP code is wrong or out of time: use the current code")
        if matched[-1] <= row[1]:
            raise AdminAuthError("TOTP code was already used: wait for the next code")
        db.execute("UPDATE settlement_admin_totp SET last_step = ? WHERE id = 1", (matched[-1],))


def _fields(message: str) -> dict[str, str]:
    lines = message.split("\n")
    fields = {"address": lines[1] if len(lines) > 1 else ""}
    for line in lines[2:]:
        key, sep, value = line.partition(": ")
        if sep:
            fields[key] = value
    return fields


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
