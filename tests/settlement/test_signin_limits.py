"""One signed challenge buys one TOTP guess, and wrong guesses lock sign-in for a minute."""

from __future__ import annotations

from pathlib import Path

import pyotp
import pytest
from solders.keypair import Keypair

from kvasird.settlement.admin import MAX_FAILED_SIGN_INS, AdminAuth
from kvasird.settlement.errors import AdminAuthError
from kvasird.settlement.ledger import Ledger

from .conftest import Clock

Auth = tuple[AdminAuth, pyotp.TOTP]


def wrong(totp: pyotp.TOTP, now: float) -> str:
    return "000000" if totp.at(now) != "000000" else "111111"


def attempt(admin: AdminAuth, operator: Keypair, code: str) -> str:
    challenge = admin.challenge()
    signature = operator.sign_message(challenge.message.encode())
    return admin.sign_in(challenge.message, signature, code).token


def fail_totp(
    admin: AdminAuth, operator: Keypair, totp: pyotp.TOTP, now: float, times: int
) -> None:
    for _ in range(times):
        with pytest.raises(AdminAuthError, match="TOTP"):
            attempt(admin, operator, wrong(totp, now))


def test_wrong_totp_code_burns_the_signed_challenge(
    auth: Auth, operator: Keypair, clock: Clock
) -> None:
    admin, totp = auth
    challenge = admin.challenge()
    signature = operator.sign_message(challenge.message.encode())
    with pytest.raises(AdminAuthError, match="TOTP"):
        admin.sign_in(challenge.message, signature, wrong(totp, clock.now))
    with pytest.raises(AdminAuthError, match="nonce unknown, used or expired"):
        admin.sign_in(challenge.message, signature, totp.at(clock.now))


def test_too_many_wrong_codes_lock_sign_in_for_a_rolling_minute(
    auth: Auth, operator: Keypair, clock: Clock
) -> None:
    admin, totp = auth
    fail_totp(admin, operator, totp, clock.now, MAX_FAILED_SIGN_INS)
    with pytest.raises(AdminAuthError, match="too many failed sign-ins: wait 60 s"):
        attempt(admin, operator, totp.at(clock.now))
    clock.now += 30
    with pytest.raises(AdminAuthError, match="wait 30 s"):
        attempt(admin, operator, totp.at(clock.now))
    clock.now += 31
    assert admin.session_valid(attempt(admin, operator, totp.at(clock.now)))


def test_failed_sign_ins_are_remembered_across_a_restart(
    auth: Auth, operator: Keypair, clock: Clock, ledger: Ledger, tmp_path: Path
) -> None:
    admin, totp = auth
    fail_totp(admin, operator, totp, clock.now, MAX_FAILED_SIGN_INS)
    ledger.close()
    restarted = AdminAuth(Ledger(tmp_path / "state.db"), operator.pubkey(), "node.example", clock)
    with pytest.raises(AdminAuthError, match="too many failed sign-ins"):
        attempt(restarted, operator, totp.at(clock.now))


def test_unsigned_attempts_do_not_lock_the_operator_out(
    auth: Auth, operator: Keypair, clock: Clock
) -> None:
    admin, totp = auth
    for _ in range(3 * MAX_FAILED_SIGN_INS):
        with pytest.raises(AdminAuthError, match="signature"):
            attempt(admin, Keypair(), totp.at(clock.now))
    assert admin.session_valid(attempt(admin, operator, totp.at(clock.now)))
