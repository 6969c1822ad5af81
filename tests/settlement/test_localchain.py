"""The local chain answers solana-py like a cluster, and survives restarts."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from solana.rpc.async_api import AsyncClient
from solders.keypair import Keypair
from solders.message import Message
from solders.rpc.responses import GetTransactionResp
from solders.transaction import Transaction

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import ChainError
from kvasird.settlement.localchain import LocalChainInfo, serve_local_chain
from kvasird.settlement.localchain.service import exposure, parse_listen
from kvasird.settlement.token import transfer_instructions

from .conftest import KVR, funded, pay


async def test_transfer_is_reported_with_owner_and_mint_token_balances(
    chain: ChainClient, local_chain: LocalChainInfo
) -> None:
    alice = await funded(chain, local_chain, 5 * KVR)
    bob = Keypair()
    sig = await pay(chain, alice, bob, local_chain.mint, 2 * KVR, memo=b"hi")
    async with AsyncClient(local_chain.url) as raw:
        resp = await raw.get_transaction(sig, max_supported_transaction_version=0)
    assert isinstance(resp, GetTransactionResp)
    meta = resp.value.transaction.meta
    pre = {str(b.owner): int(b.ui_token_amount.amount) for b in meta.pre_token_balances}
    post = {str(b.owner): int(b.ui_token_amount.amount) for b in meta.post_token_balances}
    assert pre == {str(alice.pubkey()): 5 * KVR}
    assert post == {str(alice.pubkey()): 3 * KVR, str(bob.pubkey()): 2 * KVR}
    assert {str(b.mint) for b in meta.post_token_balances} == {str(local_chain.mint)}
    assert await chain.token_balance(bob.pubkey(), local_chain.mint) == 2 * KVR


async def test_state_survives_a_restart_of_the_local_chain(tmp_path: Path) -> None:
    data = tmp_path / "chain"
    alice, bob = Keypair(), Keypair()
    async with trio.open_nursery() as nursery:
        first: LocalChainInfo = await nursery.start(serve_local_chain, data)
        async with ChainClient(first.url, poll_interval_s=0.005) as client:
            await client.faucet(alice.pubkey(), kvr=7 * KVR, lamports=10**9)
            await client.faucet(bob.pubkey(), lamports=10**9)
            sig = await pay(client, alice, bob, first.mint, 3 * KVR)
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        second: LocalChainInfo = await nursery.start(serve_local_chain, data)
        async with ChainClient(second.url, poll_interval_s=0.005) as client:
            assert (second.mint, second.genesis_wallet) == (first.mint, first.genesis_wallet)
            assert await client.token_balance(alice.pubkey(), second.mint) == 4 * KVR
            assert await client.token_balance(bob.pubkey(), second.mint) == 3 * KVR
            assert (await client.transaction(sig)).token_deltas  # history kept
            await pay(client, bob, alice, second.mint, KVR)  # and it keeps working
            assert await client.token_balance(alice.pubkey(), second.mint) == 5 * KVR
        nursery.cancel_scope.cancel()


async def test_resending_a_landed_transaction_is_refused(
    chain: ChainClient, local_chain: LocalChainInfo
) -> None:
    alice = await funded(chain, local_chain, KVR)
    tx = await chain.sign(
        [alice], transfer_instructions(alice.pubkey(), Keypair().pubkey(), local_chain.mint, 10)
    )
    await chain.send(tx)
    with pytest.raises(ChainError, match="already been processed"):
        await chain.send(tx, preflight=False)


async def test_failed_transaction_lands_with_its_error_and_moves_nothing(
    chain: ChainClient, local_chain: LocalChainInfo
) -> None:
    alice = await funded(chain, local_chain, KVR)
    tx = await chain.sign(
        [alice],
        transfer_instructions(alice.pubkey(), Keypair().pubkey(), local_chain.mint, 2 * KVR),
    )
    with pytest.raises(ChainError, match="simulation failed"):
        await chain.send(tx)
    sig = await chain.send(tx, preflight=False)
    landed = await chain.transaction(sig)
    assert landed is not None and landed.error is not None
    assert all(d.change == 0 for d in landed.token_deltas)


async def test_health_and_faucet_are_local_only_rpc(
    local_chain: LocalChainInfo, chain: ChainClient
) -> None:
    async with httpx.AsyncClient() as http:
        assert (await http.get(local_chain.url + "/health")).json() == "ok"
    assert await chain.healthy()
    assert await chain.request("kvasir_localChain", []) == {
        "mint": str(local_chain.mint),
        "genesisWallet": str(local_chain.genesis_wallet),
    }


def test_a_local_chain_listens_beyond_loopback_only_where_named_and_with_a_warning() -> None:
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert exposure("127.0.0.1") is None and exposure("::1") is None
    # a LAN address, as a network built by hand names it (192.0.2.0/24: documentation only;
    # nothing is bound or dialled here)
    assert parse_listen("192.0.2.10:8899") == ("192.0.2.10", 8899)
    warning = exposure("192.0.2.10")
    assert warning is not None and "anyone who reaches it can mint test KVR" in warning
    for bad in ("localhost:8899", "192.0.2.10", "192.0.2.10:99999", "chain.example:8899"):
        with pytest.raises(ChainError, match="must be an IP host:port"):
            parse_listen(bad)


async def test_the_chain_client_reads_a_local_chains_mint_and_genesis_wallet(
    local_chain: LocalChainInfo, chain: ChainClient
) -> None:
    keys = await chain.local_chain_keys()
    assert (keys.mint, keys.genesis_wallet) == (local_chain.mint, local_chain.genesis_wallet)


async def test_transaction_with_a_forged_signature_is_refused(
    chain: ChainClient, local_chain: LocalChainInfo
) -> None:
    victim, thief = await funded(chain, local_chain, KVR), await funded(chain, local_chain)
    blockhash, _ = await chain.latest_blockhash()
    message = Message.new_with_blockhash(
        transfer_instructions(victim.pubkey(), thief.pubkey(), local_chain.mint, KVR),
        thief.pubkey(),
        blockhash,
    )
    forged = Transaction.populate(message, [thief.sign_message(bytes(message))] * 2)
    for preflight in (True, False):
        with pytest.raises(ChainError, match="Signature"):
            await chain.send(forged, preflight=preflight)
    assert await chain.token_balance(victim.pubkey(), local_chain.mint) == KVR


async def test_malformed_requests_get_errors_and_the_chain_keeps_serving(
    local_chain: LocalChainInfo, chain: ChainClient
) -> None:
    async with httpx.AsyncClient() as http:
        for body in (
            b"{not json",
            b'{"jsonrpc":"2.0","id":1,"method":"getBalance","params":["x"]}',
            b'{"jsonrpc":"2.0","id":2,"method":"sendTransaction","params":["AAAA",'
            b'{"encoding":"base64"}]}',
            b'{"jsonrpc":"2.0","id":3,"method":"nope"}',
        ):
            reply = (await http.post(local_chain.url, content=body)).json()
            assert "error" in reply and "result" not in reply
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", int(local_chain.url.rsplit(":", 1)[1]))
        await stream.send_all(b"GARBAGE / HTTP/9\r\n\r\n")
        await stream.aclose()
    assert await chain.healthy()
