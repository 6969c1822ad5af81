"""A paid quote serves one request; a request that did no work gives its payment back."""

from __future__ import annotations

from kvasird.settlement.ledger import Ledger
from kvasird.settlement.redemptions import Redemptions


def test_a_payment_redeemed_once_is_refused_the_second_time(ledger: Ledger) -> None:
    redemptions = Redemptions(ledger)
    assert not redemptions.redeemed("r1")
    assert redemptions.redeem("r1")
    assert redemptions.redeemed("r1")
    assert not redemptions.redeem("r1")


def test_a_released_payment_pays_for_the_request_sent_again(ledger: Ledger) -> None:
    redemptions = Redemptions(ledger)
    redemptions.redeem("r1")
    redemptions.release("r1")
    assert not redemptions.redeemed("r1")
    assert redemptions.redeem("r1")


def test_redemptions_outlive_a_restart(ledger: Ledger) -> None:
    Redemptions(ledger).redeem("r1")
    assert not Redemptions(Ledger(ledger.path)).redeem("r1")
