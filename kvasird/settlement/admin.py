"""Operator admin sign-in: a Sign-In-With-Solana message signed by the operator wallet, plus TOTP.

    challenge()  → a SIWS-style message with domain, address, a single-use nonce, expiry
    sign_in()    ← that message, the wallet's signature, a TOTP code → a session (token, expiry)

A challenge is good for one attempt: its nonce is deleted (and committed) before
anything is checked, so one signed message buys one TOTP guess. The TOTP time step
is recorded when a code is accepted, so no code works twice (pyotp alone accepts a
code again within its window). Wrong codes are recorded in SQLite: after
``MAX_FAILED_SIGN_INS`` of them in ``FAILED_SIGN_IN_WINDOW_S`` every sign-in is refused
until the oldest ages out, across restarts. Only attempts whose wallet signature
verified count, so no one without the operator key can lock the operator out.
Session tokens are random; only their hashes are stored, and comparisons are
constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import pyotp
from solders.pubkey import Pubkey
from solders.signature import Signature

from kvasird.settlement.errors import AdminAuthError, TotpAlreadyEnrolled
from kvasird.settlement.ledger import Ledger

NONCE_TTL_S = 300.0
SESSION_TTL_S = 3600.0
_TOTP_WINDOW = 1
MAX_FAILED_SIGN_INS = 5
"""Wrong TOTP codes allowed per rolling window: enough for typos, far too few to guess."""
FAILED_SIGN_IN_WINDOW_S = 60.0
"""The rolling window over which failed sign-ins are counted."""


@dataclass(frozen=True)
class SignInChallenge:
    """What the operator's wallet is asked to sign."""

    message: str
    """The SIWS text; sign its UTF-8 bytes."""
    nonce: str
    """Single-use server nonce embedded in the message."""
    expires_at: float
    """Unix time after which the message is refused."""


@dataclass(frozen=True)
class AdminSession:
    """A signed-in operator's session."""

    token: str
    """Bearer token; only its hash is stored."""
    expires_at: float
    """Unix time after which the token is refused."""


class AdminAuth:
    def __init__(
        self, ledger: Ledger, operator: Pubkey, domain: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._ledger = ledger
        self._operator = operator
        self._domain = domain
        self._clock = clock

    def enroll_totp(self) -> str:
        """Create the TOTP secret; returns the otpauth:// URI for an authenticator.

        Only once: replacing the secret would let whoever asks take over the second factor.
        """
        secret = pyotp.random_base32()
        try:
            with self._ledger.transaction() as db:
                db.execute("INSERT INTO settlement_admin_totp VALUES (1, ?, -1)", (secret,))
        except sqlite3.IntegrityError:
            raise TotpAlreadyEnrolled(
                "TOTP is already enrolled: sign in with the code of the authenticator that "
                "scanned it"
            ) from None
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

    def sign_in(self, message: str, signature: Signature, totp_code: str) -> AdminSession:
        """Verify wallet signature + TOTP; returns the session. Each challenge is tried once."""
        now = self._clock()
        self._refuse_while_locked_out(now)
        fields = _fields(message)
        with self._ledger.transaction() as db:
            gone = db.execute(
                "DELETE FROM settlement_admin_nonces WHERE nonce = ? AND expires_at >= ?",
                (fields.get("Nonce", ""), now),
            )
        if not message.startswith(f"{self._domain} wants you to sign in") or fields.get(
            "address"
        ) != str(self._operator):
            raise AdminAuthError(
                f"sign-in message is not for {self._domain} and operator {self._operator}"
            )
        if not signature.verify(self._operator, message.encode()):
            raise AdminAuthError("signature does not verify against the operator wallet")
        if gone.rowcount != 1:
            raise AdminAuthError("nonce unknown, used or expired: request a new challenge")
        with self._ledger.transaction() as db:
            refusal = self._consume_totp(db, totp_code, now)
            if refusal is not None:
                db.execute(
                    "DELETE FROM settlement_admin_failures WHERE at <= ?",
                    (now - FAILED_SIGN_IN_WINDOW_S,),
                )
                db.execute("INSERT INTO settlement_admin_failures VALUES (?)", (now,))
            else:
                session = AdminSession(secrets.token_urlsafe(32), now + SESSION_TTL_S)
                db.execute(
                    "INSERT INTO settlement_admin_sessions VALUES (?, ?)",
                    (_hash(session.token), session.expires_at),
                )
        if refusal is not None:
            raise AdminAuthError(refusal)
        return session

    def session_valid(self, token: str) -> bool:
        wanted = _hash(token)
        row = self._ledger.one(
            "SELECT token_hash, expires_at FROM settlement_admin_sessions WHERE token_hash = ?",
            wanted,
        )
        return row is not None and hmac.compare_digest(row[0], wanted) and row[1] >= self._clock()

    def _refuse_while_locked_out(self, now: float) -> None:
        recent = [
            row[0]
            for row in self._ledger.db.execute(
                "SELECT at FROM settlement_admin_failures WHERE at > ? ORDER BY at DESC LIMIT ?",
                (now - FAILED_SIGN_IN_WINDOW_S, MAX_FAILED_SIGN_INS),
            )
        ]
        if len(recent) >= MAX_FAILED_SIGN_INS:
            wait = math.ceil(min(recent) + FAILED_SIGN_IN_WINDOW_S - now)
            raise AdminAuthError(
                f"too many failed sign-ins: wait {wait} s, then sign a new challenge"
            )

    def _consume_totp(self, db: sqlite3.Connection, code: str, now: float) -> str | None:
        """Accept ``code`` and record its time step; else the reason it was refused."""
        row = db.execute(
            "SELECT secret, last_step FROM settlement_admin_totp WHERE id = 1"
        ).fetchone()
        if row is None:
            return "TOTP is not enrolled: enrol it on the node's machine (POST /v0/auth/totp)"
        totp = pyotp.TOTP(row[0])
        step = int(now // totp.interval)
        matched = [
            s
            for s in range(step - _TOTP_WINDOW, step + _TOTP_WINDOW + 1)
            if hmac.compare_digest(totp.at(s * totp.interval), code.strip())
        ]
        if not matched:
            return "TOTP code is wrong or out of time: use the current code"
        if matched[-1] <= row[1]:
            return "TOTP code was already used: wait for the next code"
        db.execute("UPDATE settlement_admin_totp SET last_step = ? WHERE id = 1", (matched[-1],))
        return None


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
