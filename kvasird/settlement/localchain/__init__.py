"""The embedded local chain: LiteSVM behind a Solana JSON-RPC facade (on loopback, unless
an operator names another address).

genesis.py   the authority (mint authority, faucet, genesis wallet) and KVR mint keys
store.py     SQLite persistence: touched accounts, transaction history, blockhashes
chain.py     LocalChain: executes transactions, records token balances, slots
rpc.py       JSON-RPC methods in a cluster's shapes (+ kvasir_requestTokens faucet)
http.py      the small trio/h11 HTTP server
service.py   serve_local_chain(): run it in a nursery
faucet.py    what a local gateway gets above its stake (OWN_USE)
base58.py    Base58 (Bitcoin alphabet), for instruction data in JSON-encoded transactions
"""

from kvasird.settlement.localchain.service import LocalChainInfo, serve_local_chain

__all__ = ["LocalChainInfo", "serve_local_chain"]
