"""``kvasird wallet``: the operator wallet — address, balances, pending earnings, link, faucet."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import trio
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from kvasird.cli import home_of
from kvasird.config.schema import SettlementSection
from kvasird.db import connect
from kvasird.errors import ConfigError, HomeError
from kvasird.home import Home
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import ChainRefused, WalletError
from kvasird.settlement.governance import Governance
from kvasird.settlement.ledger import Ledger
from kvasird.settlement.localchain.faucet import OWN_USE
from kvasird.settlement.pricing import GENESIS_PARAMS, NetworkParams
from kvasird.settlement.receipts import ReceiptBook
from kvasird.settlement.token import KVR_DECIMALS, format_kvr
from kvasird.settlement.wallet import Wallet, parse_address, read_keypair, sign_link, write_keypair

_LAMPORTS_PER_SOL = 10**9
LOCAL_RPC = "http://127.0.0.1:8899"
"""Where `kvasird localchain` listens by default."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "wallet", help="operator wallet: address, SOL/KVR balances, pending earnings"
    )
    p.add_argument(
        "--keypair",
        type=Path,
        default=None,
        help="keypair file (default: [settlement] wallet, else <home>/wallet.json)",
    )
    p.add_argument("--address", default="", help="show this address instead of a keypair file's")
    p.add_argument(
        "--rpc",
        default="",
        help=f"Solana JSON-RPC URL (default: [settlement] rpc_url, else {LOCAL_RPC})",
    )
    p.add_argument(
        "--mint",
        default="",
        help="KVR mint (default: [settlement] kvr_mint, else ask the local chain)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON (amounts in base units: lamports, KVR x 10^6)",
    )
    p.set_defaults(func=_show)
    cmds = p.add_subparsers(dest="wallet_command", metavar="ACTION")
    new = cmds.add_parser("new", help="create a keypair file (Solana JSON format, mode 0600)")
    new.set_defaults(func=_new)
    link = cmds.add_parser("link", help="print this wallet's signed link to a peer id (JSON)")
    link.add_argument("peer_id", nargs="?", default="", help="peer id (default: this node's)")
    link.add_argument("--network", default="", help="network name (default: from kvasird.toml)")
    link.set_defaults(func=_link)
    claim = cmds.add_parser(
        "claim",
        help="claim earnings from every gateway that owes this "
        "node (the running daemon asks them; payouts checked on chain)",
    )
    claim.set_defaults(func=_claim)
    faucet = cmds.add_parser(
        "faucet",
        help="get SOL and KVR from a local chain's faucet (refused on any other chain)",
        description="Mint test KVR and SOL on a kvasird local chain. A gateway needs the "
        "network's stake in its wallet (the peers check it on chain) and KVR above it for "
        "its operator's own requests: --stake mints both. On a real network KVR is bought "
        "or earned, and there is no faucet.",
    )
    amount = faucet.add_mutually_exclusive_group()
    amount.add_argument("--kvr", type=float, default=None, help="KVR to mint (default 100)")
    amount.add_argument(
        "--stake",
        action="store_true",
        help=f"mint what a gateway needs: the network's stake parameter plus "
        f"{OWN_USE // 10**KVR_DECIMALS} KVR for its operator's own use",
    )
    faucet.add_argument("--sol", type=float, default=1.0, help="SOL for fees (default 1)")
    faucet.set_defaults(func=_faucet)


def _home(args: argparse.Namespace) -> Home:
    """The home; needed only when neither --address nor --keypair says which wallet."""
    return home_of(args, required=not (args.address or args.keypair))


def _settlement(home: Home) -> SettlementSection | None:
    """The home's [settlement] section (None where the home has no kvasird.toml yet)."""
    from kvasird.config.load import load

    if not home.config.exists():
        return None
    return load(home.config).settlement


def keypair_path(args: argparse.Namespace) -> Path:
    """The wallet's keypair file: --keypair (pay's --wallet), else [settlement] wallet, else
    <home>/wallet.json (what `wallet` and `pay` use)."""
    if args.keypair:
        return args.keypair.expanduser()
    home = _home(args)
    configured = _settlement(home)
    name = configured.wallet if configured and configured.wallet else "wallet.json"
    return home.root / Path(name).expanduser()


def rpc_and_mint(args: argparse.Namespace) -> tuple[str, str]:
    """(RPC URL, KVR mint) from the flags, else [settlement], else the local chain's."""
    configured = _settlement(_home(args))
    rpc = args.rpc or (configured.rpc_url if configured else "") or LOCAL_RPC
    return rpc, args.mint or (configured.kvr_mint if configured else "")


def _wallet(args: argparse.Namespace) -> Wallet:
    if args.address:
        return Wallet(parse_address(args.address))
    return Wallet.load(keypair_path(args))


def _show(args: argparse.Namespace) -> int:
    wallet = _wallet(args)
    sol, kvr, mint = trio.run(_balances, *rpc_and_mint(args), wallet.address)
    gateways = _receipts(_home(args))
    pending = sum(unpaid for _, _, unpaid in gateways)
    if args.json:
        print(
            json.dumps(
                {
                    "address": str(wallet.address),
                    "lamports": sol,
                    "kvr": kvr,
                    "mint": str(mint),
                    "pending": pending,
                    "gateways": [
                        {"wallet": str(g), "peer_id": p, "unpaid": u} for g, p, u in gateways
                    ],
                }
            )
        )
        return 0
    print(f"address           {wallet.address}")
    print(f"SOL               {sol / _LAMPORTS_PER_SOL:.9f}")
    print(f"KVR               {format_kvr(kvr)}")
    print(f"KVR mint          {mint}")
    print(f"pending earnings  {format_kvr(pending)} KVR (receipts not yet paid)")
    for gateway, peer_id, unpaid in gateways:
        print(f"  from gateway {gateway} ({peer_id[:16]}…)  {format_kvr(unpaid)} KVR")
    if pending:
        print("claim them with `kvasird wallet claim` while the daemon runs")
    return 0


async def _balances(rpc: str, mint: str, address: Pubkey) -> tuple[int, int, Pubkey]:
    async with ChainClient(rpc) as chain:
        try:
            mint_key = parse_address(mint) if mint else (await chain.local_chain_keys()).mint
        except ChainRefused:
            raise WalletError(
                f"the chain at {rpc} does not name its KVR mint (only a kvasird "
                "local chain does): pass --mint, or set [settlement] kvr_mint "
                "in kvasird.toml"
            ) from None
        return (
            await chain.lamports(address),
            await chain.token_balance(address, mint_key),
            mint_key,
        )


def _receipts(home: Home) -> list[tuple[Pubkey, str, int]]:
    """(gateway wallet, its peer id, unpaid) of every gateway this node holds receipts of."""
    if not home.db.exists():
        return []
    connect(home.db).close()  # a damaged or empty state.db is one line, and never replaced
    ledger = Ledger(home.db)
    try:
        return ReceiptBook(ledger, "", "").gateways()
    finally:
        ledger.close()


def _claim(args: argparse.Namespace) -> int:
    from kvasird.admin.client import post

    answer = post(home_of(args), "/v0/wallet/claim")
    if "error" in answer:
        print(f"claim refused: {answer['error']}")
        return 1
    claims = answer["claims"]
    if not claims:
        print("no gateway owes this node anything: nothing to claim")
    for c in claims:
        if c["error"]:
            print(f"gateway {c['gateway']}: claim failed: {c['error']}")
        else:
            print(
                f"gateway {c['gateway']}: {format_kvr(c['amount'])} KVR paid, "
                f"transaction {c['signature']} (checked on chain)"
            )
    return 1 if any(c["error"] for c in claims) else 0


def _new(args: argparse.Namespace) -> int:
    path = keypair_path(args)
    if not path.parent.is_dir():
        raise WalletError(
            f"cannot write {path}: {path.parent} does not exist "
            "(create it, or pass --keypair FILE in an existing directory)"
        )
    keypair = Keypair()
    write_keypair(path, keypair)
    print(f"address  {keypair.pubkey()}")
    print(f"keypair  {path} (back it up: it controls the funds)")
    return 0


def _link(args: argparse.Namespace) -> int:
    home = home_of(args)
    keypair = read_keypair(keypair_path(args))
    peer_id = args.peer_id or _node_peer_id(home)
    network = args.network or _network(home)
    print(json.dumps(sign_link(keypair, peer_id, network).to_wire(), indent=2))
    return 0


def _node_peer_id(home: Home) -> str:
    from kvasird.identity import load_node_key

    home.require_initialised()
    return load_node_key(home.node_key).peer_id.to_string()


def _network(home: Home) -> str:
    from kvasird.config.load import load

    try:
        return load(home.config).node.network
    except (ConfigError, HomeError):
        return "kvasir-local"


def _faucet(args: argparse.Namespace) -> int:
    wallet = _wallet(args)
    lamports = int(args.sol * _LAMPORTS_PER_SOL)
    trio.run(_fund, args, rpc_and_mint(args)[0], wallet.address, lamports)
    return 0


async def _fund(args: argparse.Namespace, rpc: str, address: Pubkey, lamports: int) -> None:
    """Mint what was asked on a local chain; any other chain is refused before anything."""
    async with ChainClient(rpc) as chain:
        try:
            keys = await chain.local_chain_keys()
        except ChainRefused:
            raise WalletError(
                f"{rpc} is not a kvasird local chain: it has no faucet. On a real network KVR "
                "is bought or earned, and a gateway's wallet must hold the network's stake "
                '(see docs/market.md, "Stake")'
            ) from None
        if args.stake:
            stake = _params(args, keys.genesis_wallet).stake_min
            kvr = stake + OWN_USE
            what = (
                f"the network's stake, {format_kvr(stake)} KVR, which the peers check "
                f"on chain before they serve this wallet's gateway, and "
                f"{format_kvr(OWN_USE)} KVR above it for the operator's own requests"
            )
        else:
            kvr = int((100.0 if args.kvr is None else args.kvr) * 10**KVR_DECIMALS)
            what = "test KVR"
        await chain.faucet(address, kvr=kvr, lamports=lamports)
    print(
        f"funded {address}: {format_kvr(kvr)} KVR ({what}), "
        f"{lamports / _LAMPORTS_PER_SOL:g} SOL for fees"
    )


def _params(args: argparse.Namespace, genesis: Pubkey) -> NetworkParams:
    """The network parameters in force, as this node last heard them from its network's
    genesis wallet (the genesis ones while it has heard none, or has no home)."""
    home = _home(args)
    if not home.db.exists():
        return GENESIS_PARAMS
    ledger = Ledger(home.db)
    try:
        return Governance(ledger, genesis, _network(home)).params()
    finally:
        ledger.close()
