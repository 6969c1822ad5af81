"""Admin sign-in needs the operator wallet's signature on a fresh nonce and an unused TOTP code."""

from __future__ import annotations

import pytest
from solders.keypair import Keypair

from kvasird.settlement.errors import AdminAuthError

from .conftest import Clock


def test_operator_signs_in_with_wallet_and_totp(auth, operator: Keypair, clock: Clock) -> None:
    admin, totp = auth
    challenge = admin.challenge()
    assert (
        challenge.message.startswith("node.example wants you to sign in")
        and challenge.nonce in challenge.message
    )
    token = admin.sign_in(
        challenge.message, operator.sign_message(challenge.message.encode()), totp.at(clock.now)
    ).token
    assert admin.session_valid(token)
    assert not admin.session_valid(token + "x")


def test_totp_code_cannot_be_replayed(auth, operator: Keypair, clock: Clock) -> None:
    admin, totp = auth
    code = totp.at(clock.now)
    first = admin.challenge()
    admin.sign_in(first.message, operator.sign_message(first.message.encode()), code)
    second = admin.challenge()
    with pytest.raises(AdminAuthError, match="already used"):
        admin.sign_in(second.message, operator.sign_message(second.message.encode()), code)
    clock.now += 30
    third = admin.challenge()
    admin.sign_in(third.message, operator.sign_message(third.message.encode()), totp.at(clock.now))


def test_signed_challenge_cannot_be_replayed(auth, operator: Keypair, clock: Clock) -> None:
    admin, totp = auth
    challenge = admin.challenge()
    signature = operator.sign_message(challenge.message.encode())
    admin.sign_in(challenge.message, signature, totp.at(clock.now))
    clock.now += 30
    with pytest.raises(AdminAuthError, match="nonce"):
        admin.sign_in(challenge.message, signature, totp.at(clock.now))


def test_other_wallet_or_wrong_code_or_expired_nonce_is_refused(
    auth, operator: Keypair, clock: Clock
) -> None:
    admin, totp = auth
    challenge = admin.challenge()
    with pytest.raises(AdminAuthError, match="signature"):
        admin.sign_in(
            challenge.message,
            Keypair().sign_message(challenge.message.encode()),
            totp.at(clock.now),
        )
    challenge = admin.challenge()
    with pytest.raises(AdminAuthError, match="TOTP"):
        admin.sign_in(
            challenge.message,
            operator.sign_message(challenge.message.encode()),
            "000000" if totp.at(clock.now) != "000000" else "111111",
        )
    challenge = admin.challenge()
    clock.now += 301
    with pytest.raises(AdminAuthError, match="expired"):
        admin.sign_in(
            challenge.message, operator.sign_message(challenge.message.encode()), totp.at(clock.now)
        )
