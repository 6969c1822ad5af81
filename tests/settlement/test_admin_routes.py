"""The admin API answers other machines only with an operator session; TOTP enrols locally, once."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pyotp
import pytest
from solders.keypair import Keypair

from kvasird.admin.server import AdminNode, build_app
from kvasird.gateway.status import NodeView
from kvasird.settlement.admin import AdminAuth
from kvasird.settlement.ledger import Ledger

from .conftest import Clock

REMOTE = ("203.0.113.9", 1234)
LOOPBACK = ("127.0.0.1", 1234)


@dataclass(frozen=True)
class AdminOnlySettlement:
    """The part of Settlement the auth routes use."""

    admin: AdminAuth


def stand_in_node(settlement: AdminOnlySettlement | None) -> AdminNode:
    """What the admin API's status and auth routes read of a node: its status and its
    settlement; the rest is empty, and nothing dials."""

    def empty() -> dict[str, Any]:
        return {}

    view = NodeView(status=lambda: {"peer_id": "12D3KooWStandIn"}, peers=list, coverage=empty,
                    shards=empty, earnings=empty, checks=empty)
    return AdminNode(view, None, lambda: settlement,  # type: ignore[arg-type,return-value]
                     health=None)


Client = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def admin(ledger: Ledger, operator: Keypair, clock: Clock) -> AdminAuth:
    return AdminAuth(ledger, operator.pubkey(), "kvasird", clock=clock)


@pytest.fixture
def client(admin: AdminAuth) -> Client:
    @asynccontextmanager
    async def connect(
        peer: tuple[str, int], settlement: bool = True
    ) -> AsyncIterator[httpx.AsyncClient]:
        node = stand_in_node(AdminOnlySettlement(admin) if settlement else None)
        transport = httpx.ASGITransport(app=build_app(node), client=peer)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            yield http

    return connect


async def enrol(client: Client) -> pyotp.TOTP:
    async with client(LOOPBACK) as http:
        answer = await http.post("/v0/auth/totp")
    assert answer.status_code == 200, answer.text
    return pyotp.TOTP(re.search(r"secret=([A-Z2-7]+)", answer.json()["uri"]).group(1))


async def sign_in(http: httpx.AsyncClient, operator: Keypair, code: str) -> httpx.Response:
    challenge = (await http.post("/v0/auth/challenge")).json()
    signature = operator.sign_message(challenge["message"].encode())
    return await http.post(
        "/v0/auth/sign-in",
        json={"message": challenge["message"], "signature": str(signature), "totp": code},
    )


async def test_remote_client_without_a_session_is_told_how_to_sign_in(client: Client) -> None:
    async with client(REMOTE) as http:
        answer = await http.get("/v0/status")
    assert answer.status_code == 401
    assert "/v0/auth/challenge" in answer.json()["error"]


async def test_loopback_clients_need_no_session(client: Client) -> None:
    for peer in (LOOPBACK, ("::1", 1234), ("::ffff:127.0.0.1", 1234)):
        async with client(peer) as http:
            assert (await http.get("/v0/status")).json() == {"peer_id": "12D3KooWStandIn"}


async def test_remote_operator_signs_in_and_uses_the_session(
    client: Client, operator: Keypair, clock: Clock
) -> None:
    totp = await enrol(client)
    async with client(REMOTE) as http:
        signed_in = await sign_in(http, operator, totp.at(clock.now))
        assert signed_in.status_code == 200, signed_in.text
        session = signed_in.json()
        assert session["expires_at"] > clock.now
        bearer = {"Authorization": f"Bearer {session['token']}"}
        assert (await http.get("/v0/status", headers=bearer)).status_code == 200
        forged = {"Authorization": f"Bearer {session['token']}x"}
        assert (await http.get("/v0/status", headers=forged)).status_code == 401


async def test_failed_sign_in_answers_401_with_the_reason(
    client: Client, operator: Keypair, clock: Clock
) -> None:
    totp = await enrol(client)
    wrong = "000000" if totp.at(clock.now) != "000000" else "111111"
    async with client(REMOTE) as http:
        refused = await sign_in(http, operator, wrong)
        other_wallet = await sign_in(http, Keypair(), totp.at(clock.now))
    assert refused.status_code == 401 and "TOTP code is wrong" in refused.json()["error"]
    assert other_wallet.status_code == 401 and "signature" in other_wallet.json()["error"]


async def test_malformed_sign_in_is_a_bad_request(client: Client) -> None:
    async with client(REMOTE) as http:
        not_base58 = await http.post(
            "/v0/auth/sign-in", json={"message": "m", "signature": "0OIl", "totp": "123456"}
        )
        missing = await http.post("/v0/auth/sign-in", json={"message": "m"})
    assert not_base58.status_code == 400 and "base58" in not_base58.json()["error"]
    assert missing.status_code == 400 and "`signature` is required" in missing.json()["error"]


async def test_totp_enrols_once_and_only_from_this_machine(
    client: Client, operator: Keypair, clock: Clock
) -> None:
    totp = await enrol(client)
    async with client(LOOPBACK) as http:
        again = await http.post("/v0/auth/totp")
    assert again.status_code == 409 and "already enrolled" in again.json()["error"]
    async with client(REMOTE) as http:
        token = (await sign_in(http, operator, totp.at(clock.now))).json()["token"]
        remote = await http.post("/v0/auth/totp", headers={"Authorization": f"Bearer {token}"})
    assert remote.status_code == 403 and "this machine" in remote.json()["error"]


async def test_without_settlement_remote_clients_are_refused(client: Client) -> None:
    async with client(REMOTE, settlement=False) as http:
        status = await http.get("/v0/status")
        challenge = await http.post("/v0/auth/challenge")
    assert status.status_code == 401 and "[settlement]" in status.json()["error"]
    assert challenge.status_code == 404 and "[settlement]" in challenge.json()["error"]
