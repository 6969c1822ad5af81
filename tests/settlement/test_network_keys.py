"""Settlement from the RPC URL alone: a local chain names its mint and genesis wallet, a
chain that cannot stops the daemon with what to set, and a silent one is waited for."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from solders.keypair import Keypair
from trio.testing import MockClock

from kvasird.config.schema import SettlementSection
from kvasird.home import Home
from kvasird.localnet.launcher import free_port
from kvasird.settlement.config import SettlementConfig
from kvasird.settlement.errors import ChainError
from kvasird.settlement.localchain import LocalChainInfo, serve_local_chain
from kvasird.settlement.localchain.http import serve_http
from kvasird.settlement.service import CHAIN_WAIT_S, run_settlement, with_network_keys

CONFIG = "/var/lib/kvasird/kvasird.toml"


def cluster(body: bytes) -> bytes:
    """A Solana cluster's answer to kvasird's local-only methods: there is no such method."""
    rid = json.loads(body)["id"]
    return json.dumps({"jsonrpc": "2.0", "id": rid,
                       "error": {"code": -32601, "message": "Method not found"}}).encode()


async def test_a_node_given_only_a_local_chains_url_settles_with_its_mint(
    nursery: trio.Nursery, local_chain: LocalChainInfo, tmp_path: Path
) -> None:
    config = SettlementConfig(SettlementSection(rpc_url=local_chain.url))
    filled = await with_network_keys(config, CONFIG)
    assert filled.section.kvr_mint == str(local_chain.mint)
    assert filled.section.genesis_wallet == str(local_chain.genesis_wallet)
    config = SettlementConfig(replace(config.section, wallet_address=str(Keypair().pubkey())))
    with trio.fail_after(20):
        s = await nursery.start(run_settlement, config, Home(tmp_path), "12D3KooWMe",
                                "kvasir-test")
    assert s.mint == local_chain.mint and s.local_chain is None


async def test_keys_set_in_the_config_are_kept_and_need_no_chain() -> None:
    config = SettlementConfig(
        SettlementSection(rpc_url="http://127.0.0.1:9", kvr_mint="M", genesis_wallet="G"))
    assert await with_network_keys(config, CONFIG) is config


async def test_a_chain_that_cannot_name_its_mint_says_what_to_set_where(
    nursery: trio.Nursery,
) -> None:
    port = await nursery.start(serve_http, cluster, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ChainError) as refused:
        await with_network_keys(SettlementConfig(SettlementSection(rpc_url=url)), CONFIG)
    assert str(refused.value) == (
        f"the chain at {url} does not name its KVR mint and genesis wallet (only a kvasird "
        f"local chain does): set [settlement] kvr_mint and genesis_wallet in {CONFIG} to "
        "your network's")


async def test_a_chain_that_never_answers_is_given_up_on_after_the_wait(
    autojump_clock: MockClock,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = trio.current_time()
    with pytest.raises(ChainError, match=f"did not answer within {CHAIN_WAIT_S:g} s.*rpc_url"):
        await with_network_keys(SettlementConfig(SettlementSection(rpc_url=url)), CONFIG)
    assert trio.current_time() - started == pytest.approx(CHAIN_WAIT_S)


async def test_a_chain_that_starts_after_the_node_is_waited_for(
    nursery: trio.Nursery, mock_clock: MockClock, tmp_path: Path
) -> None:
    mock_clock.autojump_threshold = 0.1  # real loopback I/O finishes before the clock jumps
    listen = f"127.0.0.1:{free_port()}"
    chain: list[LocalChainInfo] = []

    async def start_later() -> None:
        await trio.sleep(10)
        chain.append(await nursery.start(serve_local_chain, tmp_path / "chain", listen))

    nursery.start_soon(start_later)
    filled = await with_network_keys(
        SettlementConfig(SettlementSection(rpc_url=f"http://{listen}")), CONFIG)
    assert 10 <= trio.current_time() < CHAIN_WAIT_S
    assert filled.section.kvr_mint == str(chain[0].mint)
