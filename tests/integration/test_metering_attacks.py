"""A serving peer's meter against a gateway that does not pay, from outside (#36;
docs/market.md, "Credit"): a foreign libp2p peer poses as a staked gateway, a real daemon
on the local chain serves it a stage, and the daemon alone decides how much work it does.

The foreign gateway steps the same prompt from position 0 again and again and sends no
receipt; then receipts of its own making, one whose amount did not rise and one that pays;
and it speaks from a second peer id its wallet links too. Each step is ROWS positions
through LAYERS layers, so the credit predicts exactly how many steps are served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import trio
from foreign_gateway import ForeignGateway  # type: ignore[import-not-found]
from test_money import paid_net  # type: ignore[import-not-found]
from test_unadmitted_peer import ask  # type: ignore[import-not-found]

from kvasird.inference.protocol import STAGE_PROTOCOL
from kvasird.inference.protocol.stage import Open, Step
from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNetError, LocalNode
from kvasird.model.bundled import bundled_path
from kvasird.settlement.admission import TOLERANCE
from kvasird.settlement.consumer import funded_wallet
from kvasird.settlement.exchange import SETTLE_PROTOCOL, epoch_now
from kvasird.settlement.governance import sign_governance
from kvasird.settlement.localchain.genesis import load_or_create_genesis
from kvasird.settlement.pricing import GENESIS_PARAMS, GENESIS_STAKE_MIN
from kvasird.wire import pack

pytestmark = pytest.mark.slow

CREDIT = 3000
"""The network's credit_units for this test: a few steps' work."""
ROWS = 32
LAYERS = 19
"""The hop the foreign gateway opens: the embedding and layers [0, LAYERS)."""
PER_STEP = ROWS * LAYERS
PROMPT = np.arange(100, 100 + ROWS, dtype=np.int32)
MOST_STEPS = 20
"""Steps tried before giving up on a refusal: the 20 full prefills of the issue."""
ATTACK_S = 300.0
PUBLISH_TRIES = 3
PUBLISHED_S = 10.0
"""How long the victim may take to show it took a gossip message before it is sent again."""


async def request(gateway: ForeignGateway, victim: LocalNode, protocol: str,
                  msg: dict[str, Any]) -> dict[str, Any]:
    return await ask(gateway, victim.peer_id, protocol, {**msg, "id": 1})


async def step_until_refused(gateway: ForeignGateway, victim: LocalNode, sid: str
                             ) -> tuple[int, dict[str, Any]]:
    """Step the prompt from position 0 until the victim refuses (at most MOST_STEPS times):
    the steps it served, and its refusal ({} if none came)."""
    step = Step(sid, 0, PROMPT).to_wire()
    for served in range(MOST_STEPS):
        reply = await request(gateway, victim, STAGE_PROTOCOL, step)
        if "error" in reply:
            return served, reply
        assert "x" in reply, reply
    return MOST_STEPS, {}


def unpaid(refusal: dict[str, Any], wallet: str, gap: int, credit: int) -> bool:
    """Whether ``refusal`` refuses ``wallet`` for ``gap`` units its receipts do not cover
    (and their value in KVR) against a credit of ``credit`` units."""
    return refusal.get("code") == "unpaid" and re.search(
        rf"gateway wallet {wallet} has {gap} units of work done here \(about \d+\.\d+ KVR\) "
        rf"that its receipts do not cover, and its credit is {credit} units",
        refusal.get("error", "")) is not None


def test_a_wallet_is_served_its_credit_whatever_its_sessions_receipts_and_peer_ids(
        localnet: Callable[..., LocalNet]) -> None:
    """A session stepped back to 0 is metered and refused past its credit; a receipt whose
    amount did not rise renews nothing (0 at first, then the same amount with more units);
    one that pays renews as much as its amount pays for; a second peer id of the same wallet
    draws on the same credit: refused while the first has used it up, and using up what the
    first's receipt renewed."""
    net = paid_net(localnet, bundled_path(), [["head", "layers:0-30"]])
    victim = net.nodes[0]
    assert net.chain is not None
    genesis, _ = load_or_create_genesis(net.chain.data / "genesis.json")
    params = dataclasses.replace(GENESIS_PARAMS, version=GENESIS_PARAMS.version + 1,
                                 credit_units=CREDIT)
    model = victim.get("/v0/coverage")["model"]
    # what the victim should count: the steps the credit covers, an amount that pays for
    # most of their work (a base unit of a receipt's amount pays for 4000 x units per
    # token / floor units), and the steps the credit that amount renews covers
    before = CREDIT // PER_STEP
    done = before * PER_STEP
    per_base_unit = 4000 * (model["n_layer"] + 1) // params.floor
    paid = done // per_base_unit
    receipted = paid * per_base_unit
    credit = CREDIT + int(TOLERANCE * receipted)
    renewed = (credit - (done - receipted)) // PER_STEP
    metered = (before + renewed) * PER_STEP
    assert 0 < receipted < done and renewed > 0
    epoch = epoch_now()
    seen: dict[str, Any] = {}

    async def published(what: str, publish: Callable[[], Awaitable[None]],
                        predicate: Callable[[], bool]) -> None:
        """Publish until the victim shows it took the message: gossip sent before the
        victim's mesh took the foreign peer in reaches no one."""
        for _ in range(PUBLISH_TRIES):
            await publish()
            with contextlib.suppress(LocalNetError):
                await trio.to_thread.run_sync(net.wait_until, what, predicate, PUBLISHED_S)
                return
        raise AssertionError(f"{what}: not after {PUBLISH_TRIES} tries")

    async def receipt(gateway: ForeignGateway, units: int, amount: int, seq: int) -> None:
        reply = await request(gateway, victim, SETTLE_PROTOCOL, {
            "op": "receipt", "receipt": gateway.receipt(victim.peer_id, epoch, units, amount,
                                                        seq)})
        assert "error" not in reply, reply

    async def attack() -> None:
        assert net.chain is not None
        wallet = await funded_wallet(net.chain.info["RPC URL"], GENESIS_STAKE_MIN)
        seen["wallet"] = str(wallet.pubkey())
        first, second = ForeignGateway("localnet", wallet), ForeignGateway("localnet", wallet)
        async with first.running(victim.join_addr), second.running(victim.join_addr):
            governance = pack(sign_governance(genesis.authority, "localnet", params).to_wire())
            await published("the victim applies the credit",
                            lambda: first.publish("governance", governance),
                            lambda: victim.get("/v0/settlement")["params"].get(
                                "credit_units") == CREDIT)
            for gateway in (first, second):
                await published("the victim maps the foreign gateway", gateway.announce,
                                lambda g=gateway: g.peer_id in victim.get("/v0/coverage")[
                                    "holders"])
            for gateway in (first, second):
                opened = await request(gateway, victim, STAGE_PROTOCOL, Open(
                    "s", model["id"], 0, LAYERS, True, False, ROWS).to_wire())
                assert "error" not in opened, opened
            seen["first"] = await step_until_refused(first, victim, "s")
            seen["second, while the first is out"] = await step_until_refused(
                second, victim, "s")
            await receipt(first, done, 0, 1)
            seen["after a receipt of no amount"] = await step_until_refused(first, victim, "s")
            await receipt(first, done, paid, 2)
            seen["second, renewed"] = await step_until_refused(second, victim, "s")
            seen["first, after the second"] = await step_until_refused(first, victim, "s")
            await receipt(second, metered, paid, 3)
            seen["after a receipt of the same amount"] = await step_until_refused(
                second, victim, "s")
            seen["account"] = (await trio.to_thread.run_sync(victim.get, "/v0/wallet")
                               )["metered"]

    async def bounded() -> None:
        with trio.fail_after(ATTACK_S):
            await attack()

    trio.run(bounded)
    counts = {k: v[0] for k, v in seen.items() if isinstance(v, tuple)}
    print(f"steps of {ROWS} positions x {LAYERS} layers served before a refusal: {counts}")
    assert counts == {"first": before, "second, while the first is out": 0,
                      "after a receipt of no amount": 0, "second, renewed": renewed,
                      "first, after the second": 0, "after a receipt of the same amount": 0}
    wallet = seen["wallet"]
    for case, gap, allowed in (("first", done, CREDIT),
                               ("second, while the first is out", done, CREDIT),
                               ("after a receipt of no amount", done, CREDIT),
                               ("second, renewed", metered - receipted, credit),
                               ("first, after the second", metered - receipted, credit),
                               ("after a receipt of the same amount", metered - receipted,
                                credit)):
        assert unpaid(seen[case][1], wallet, gap, allowed), (case, seen[case][1])
    assert seen["account"] == {wallet: {"metered": metered, "receipted": receipted}}
    assert victim.alive(), victim.tail()
