"""The consumer's side of pay-per-inference: get a quote, pay it on chain, prove it.

Used by ``kvasird localnet`` (the demo pays for its prompt) and by tests; a developer's
own client does the same three steps with any Solana wallet.
"""

from __future__ import annotations

from typing import Any

import httpx
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.payments import prepaid_message
from kvasird.settlement.token import transfer_instructions

PAYMENT_HEADER = "X-Kvasir-Payment"


def get_quote(gateway_url: str, max_tokens: int = 0, prompt_tokens: int = 0,
              request: dict[str, Any] | None = None) -> dict[str, Any]:
    """A quote for ``prompt_tokens`` in and ``max_tokens`` out, or for ``request`` itself
    (the body about to be sent: the gateway counts its prompt)."""
    body = request if request is not None else {"max_tokens": max_tokens,
                                                "prompt_tokens": prompt_tokens}
    resp = httpx.post(f"{gateway_url}/v1/kvasir/quote", json=body, timeout=30)
    resp.raise_for_status()
    return resp.json()


async def pay_quote(rpc_url: str, payer: Keypair, quote: dict[str, Any],
                    commitment: str = "confirmed") -> str:
    """Transfer the quoted KVR to the vault with the quote's memo; return the header value."""
    ixs = transfer_instructions(payer.pubkey(), Pubkey.from_string(quote["vault"]),
                                Pubkey.from_string(quote["mint"]), int(quote["amount"]),
                                quote["memo"].encode())
    async with ChainClient(rpc_url, commitment) as chain:
        signature = await chain.send_and_confirm([payer], ixs)
    return f"{quote['request_id']}:{signature}"


def prepaid_header(payer: Keypair, quote: dict[str, Any]) -> str:
    """The header value that pays ``quote`` from ``payer``'s prepaid balance at the gateway
    (what shorter answers left unused there), with no transaction."""
    request_id = quote["request_id"]
    signature = payer.sign_message(prepaid_message(request_id))
    return f"{request_id}:{payer.pubkey()}:{signature}"


async def funded_wallet(rpc_url: str, kvr: int, lamports: int = 10**9) -> Keypair:
    """A fresh wallet from the local chain's faucet (local networks only)."""
    wallet = Keypair()
    async with ChainClient(rpc_url, "confirmed") as chain:
        await chain.faucet(wallet.pubkey(), kvr=kvr, lamports=lamports)
    return wallet
