"""Settlement as one service: ``settlement = await nursery.start(run_settlement, ...)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio
from solders.pubkey import Pubkey

from kvasird.home import Home
from kvasird.settlement.admin import AdminAuth
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.claims import Payout, Payouts, parse_claim
from kvasird.settlement.config import SettlementConfig
from kvasird.settlement.errors import ChainError, WalletError
from kvasird.settlement.governance import Governance, GovernanceMessage
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain import LocalChainInfo, serve_local_chain
from kvasird.settlement.locks import KeyedLocks
from kvasird.settlement.payments import Payments
from kvasird.settlement.pricing import NetworkParams, PriceController
from kvasird.settlement.receipts import ReceiptBook
from kvasird.settlement.rewards import Rewards
from kvasird.settlement.wallet import Wallet, WalletLink, parse_address, sign_link

_LOCAL_FEE_LAMPORTS = 10**9


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
        url = config.rpc_url
        if not url:
            started: LocalChainInfo = await nursery.start(
                serve_local_chain,
                config.local_chain_data or home.root / "localchain",
                config.local_chain_listen,
            )
            local, url = started, started.url
        mint, genesis = _network_keys(config, local, url)
        wallet = Wallet.load(config.wallet, config.wallet_address)
        ledger = Ledger(home.db)
        chain = ChainClient(url, config.commitment, config.poll_interval_s)
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


def _network_keys(
    config: SettlementConfig, local: LocalChainInfo | None, url: str
) -> tuple[Pubkey, Pubkey]:
    """KVR mint and genesis wallet: from config, else from the embedded local chain."""
    if local is None:
        if not (config.kvr_mint and config.genesis_wallet):
            raise ChainError(
                "[settlement] kvr_mint and genesis_wallet must be set for the network "
                f"served by {url}"
            )
        return parse_address(config.kvr_mint), parse_address(config.genesis_wallet)
    mint = parse_address(config.kvr_mint) if config.kvr_mint else local.mint
    genesis = (
        parse_address(config.genesis_wallet) if config.genesis_wallet else local.genesis_wallet
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
        quote_ttl_s=config.quote_ttl_s,
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
    )
