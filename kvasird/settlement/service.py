"""Settlement as one service: ``settlement = await nursery.start(run_settlement, ...)``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import trio
from solders.pubkey import Pubkey

from kvasird.home import Home
from kvasird.logs import get_logger
from kvasird.settlement.admin import AdminAuth
from kvasird.settlement.chain import ChainClient, NetworkKeys
from kvasird.settlement.claims import Payout, Payouts, parse_claim
from kvasird.settlement.config import SettlementConfig
from kvasird.settlement.errors import ChainError, ChainRefused, WalletError
from kvasird.settlement.governance import Governance, GovernanceMessage
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo, serve_local_chain
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.payments import Payments
from kvasird.settlement.pricing import NetworkParams, PriceController
from kvasird.settlement.receipts import ReceiptBook
from kvasird.settlement.redemptions import Redemptions
from kvasird.settlement.rewards import Rewards
from kvasird.settlement.wallet import Wallet, WalletLink, parse_address, sign_link

log = get_logger("kvasird.settlement")

_LOCAL_FEE_LAMPORTS = 10**9
CHAIN_WAIT_S = 40.0
"""How long a starting daemon waits for a chain that does not answer yet (a daemon and its
chain, systemd units or not, start in any order); then it exits 1 and systemd's
Restart=on-failure starts it again. Short of the unit's WatchdogSec, which runs from the
start, so that the daemon's own line, not the watchdog, says why."""
CHAIN_RETRY_S = (1.0, 2.0, 4.0, 8.0)
"""Pauses between asks while waiting for the chain (the last one repeats)."""


@dataclass(frozen=True)
class Settlement:
    """Everything the gateway and the inference layer call; built once per daemon."""

    config: SettlementConfig
    """The settings it runs with."""
    chain: ChainClient
    """RPC client (local chain or cluster)."""
    ledger: Ledger
    """The SQLite ledger in state.db."""
    wallet: Wallet
    """Operator wallet (vault owner and payout signer when it holds a keypair)."""
    mint: Pubkey
    """KVR mint."""
    prices: PriceController
    """Floating price, tuned by governance."""
    governance: Governance
    """Signed network parameters."""
    payments: Payments
    """Quotes, payment verification, deposits."""
    rewards: Rewards | None
    """Revenue split and receipts (None without a keypair: this node cannot be a paying gateway)."""
    payouts: Payouts | None
    """Claims and refunds (None without a keypair)."""
    receipts: ReceiptBook
    """This node's receipts as a serving peer."""
    admin: AdminAuth
    """Operator sign-in."""
    local_chain: LocalChainInfo | None
    """The embedded local chain, when one was started."""
    network: str
    """Network name (receipts, links and governance are bound to it)."""
    link: WalletLink | None
    """This node's payout wallet linked to its peer id (None without a keypair: the node
    can neither run a paid gateway nor claim)."""
    redemptions: Redemptions
    """Which paid quotes have served a request at this node's gateway."""

    def gateway(self) -> tuple[Rewards, Payouts]:
        if self.rewards is None or self.payouts is None:
            raise WalletError(
                f"only the address {self.wallet.address} is configured: a gateway must hold its "
                "keypair to pay out; set [settlement] wallet to the keypair file"
            )
        return self.rewards, self.payouts

    async def claim(self, peer_id: str, wire: dict[str, Any]) -> Payout:
        """A claim from ``peer_id`` (authenticated by libp2p): pay earnings to its linked wallet."""
        _, payouts = self.gateway()
        return await payouts.claim(peer_id, parse_claim(wire, peer_id, self.network))

    async def refund_failed(self, request_id: str) -> Payout:
        """A paid request that could not be served: refund its payer on chain from insurance."""
        rewards, payouts = self.gateway()
        rewards.fail(request_id)
        return await payouts.refund(request_id)

    def owed(self, me: str) -> int:
        """Base units in the vault that belong to others: what the operator may spend on its
        own requests is the vault's KVR less the network's stake minimum and this (other
        peers' unclaimed earnings, the insurance pool, consumers' prepaid balances). What
        node ``me`` earned as a peer of its own gateway is the operator's already."""
        value = self.ledger.value
        return (
            value("SELECT SUM(earned - paid) FROM settlement_earnings WHERE peer_id != ?", me)
            + value("SELECT balance FROM settlement_pools WHERE name = 'insurance'")
            + value("SELECT SUM(balance) FROM settlement_deposits")
        )

    async def stake(self, wallet: Pubkey) -> int:
        """The KVR ``wallet`` holds on chain (what a gateway's stake is checked by)."""
        return await self.chain.token_balance(wallet, self.mint)

    def apply_governance(self, wire: dict[str, Any]) -> NetworkParams:
        """A governance message from gossip: verify, store, and retune the price controller."""
        params = self.governance.apply(GovernanceMessage.from_wire(wire))
        self.prices.retune(params)
        return params


async def run_settlement(
    config: SettlementConfig,
    home: Home,
    peer_id: str,
    network: str,
    *,
    task_status: trio.TaskStatus[Settlement] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start settlement (and the local chain if no RPC URL is set); runs until cancelled."""
    async with trio.open_nursery() as nursery:
        local: LocalChainInfo | None = None
        url = config.section.rpc_url
        if not url:
            started: LocalChainInfo = await nursery.start(
                serve_local_chain,
                config.local_chain_data or home.root / "localchain",
                config.local_chain_listen,
            )
            local, url = started, started.url
        config = await with_network_keys(config, str(home.config))
        mint, genesis = _network_keys(config, local)
        operator = config.section
        wallet = Wallet.load(
            home.root / operator.wallet if operator.wallet else None, operator.wallet_address
        )
        ledger = Ledger(home.db)
        chain = ChainClient(url, operator.commitment, config.poll_interval_s)
        try:
            settlement = await _assemble(
                config, chain, ledger, wallet, mint, genesis, peer_id, network, local
            )
            task_status.started(settlement)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await chain.aclose()
            ledger.close()
            nursery.cancel_scope.cancel()


async def with_network_keys(config: SettlementConfig, config_path: str) -> SettlementConfig:
    """``config`` with the KVR mint and genesis wallet it leaves empty read from the chain at
    its RPC URL: a kvasird local chain names its own, so a network built by hand needs only
    ``rpc_url``. The daemon calls this before it joins the network, so that a chain that
    cannot name them (a cluster) stops it with one line saying what to set. Unchanged when
    both are set, or with no RPC URL (the embedded chain names its own once started)."""
    operator = config.section
    if not operator.rpc_url or (operator.kvr_mint and operator.genesis_wallet):
        return config
    async with ChainClient(operator.rpc_url) as chain:
        keys = await _wait_for_keys(chain, config_path)
    log.info(
        "the local chain named the network's KVR mint and genesis wallet",
        rpc_url=operator.rpc_url,
        mint=str(keys.mint),
        genesis_wallet=str(keys.genesis_wallet),
    )
    return replace(
        config,
        section=replace(
            operator,
            kvr_mint=operator.kvr_mint or str(keys.mint),
            genesis_wallet=operator.genesis_wallet or str(keys.genesis_wallet),
        ),
    )


async def _wait_for_keys(chain: ChainClient, config_path: str) -> NetworkKeys:
    """Ask until the chain answers, at most CHAIN_WAIT_S; say so while it does not."""
    with trio.move_on_after(CHAIN_WAIT_S):
        for pause in itertools.chain(CHAIN_RETRY_S, itertools.repeat(CHAIN_RETRY_S[-1])):
            try:
                return await chain.local_chain_keys()
            except ChainRefused:
                raise ChainError(
                    f"the chain at {chain.url} does not name its KVR mint and genesis wallet "
                    "(only a kvasird local chain does): set [settlement] kvr_mint and "
                    f"genesis_wallet in {config_path} to your network's"
                ) from None
            except ChainError as exc:
                log.warning(
                    f"waiting for the chain (up to {CHAIN_WAIT_S:g} s): {exc}", retry_in_s=pause
                )
            await trio.sleep(pause)
    raise ChainError(
        f"the chain at {chain.url} did not answer within {CHAIN_WAIT_S:g} s: check that it "
        "runs and that this machine reaches it (for a local network, `kvasird localchain "
        f"--listen HOST:PORT` on its host), or fix [settlement] rpc_url in {config_path}"
    )


def _network_keys(config: SettlementConfig, local: LocalChainInfo | None) -> tuple[Pubkey, Pubkey]:
    """KVR mint and genesis wallet: from config (filled by ``with_network_keys``), else from
    the embedded local chain."""
    operator = config.section
    if local is None:
        return parse_address(operator.kvr_mint), parse_address(operator.genesis_wallet)
    mint = parse_address(operator.kvr_mint) if operator.kvr_mint else local.mint
    genesis = (
        parse_address(operator.genesis_wallet) if operator.genesis_wallet else local.genesis_wallet
    )
    return mint, genesis


async def _assemble(
    config: SettlementConfig,
    chain: ChainClient,
    ledger: Ledger,
    wallet: Wallet,
    mint: Pubkey,
    genesis: Pubkey,
    peer_id: str,
    network: str,
    local: LocalChainInfo | None,
) -> Settlement:
    locks = KeyedLocks()
    governance = Governance(ledger, genesis, network)
    prices = PriceController(governance.params())
    payments = Payments(
        ledger,
        chain,
        vault=wallet.address,
        mint=mint,
        prices=prices,
        locks=locks,
        quote_ttl_s=config.section.quote_ttl_s,
    )
    rewards = payouts = None
    if wallet.keypair is not None:
        if local is not None and await chain.lamports(wallet.address) < _LOCAL_FEE_LAMPORTS:
            await chain.faucet(wallet.address, lamports=_LOCAL_FEE_LAMPORTS)
        rewards = Rewards(ledger, wallet.keypair, network, config.split, config.tiers)
        payouts = Payouts(ledger, chain, wallet.keypair, mint, locks, config.confirm_timeout_s)
        await payouts.reconcile()
    return Settlement(
        config,
        chain,
        ledger,
        wallet,
        mint,
        prices,
        governance,
        payments,
        rewards,
        payouts,
        ReceiptBook(ledger, peer_id, network),
        AdminAuth(ledger, wallet.address, "kvasird"),
        local,
        network,
        sign_link(wallet.keypair, peer_id, network) if wallet.keypair is not None else None,
        Redemptions(ledger),
    )
