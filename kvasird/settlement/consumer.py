"""The consumer's side of pay-per-inference: get a quote, pay it on chain, prove it.

``Consumer`` (and ``pay_and_ask`` outside trio) does the three steps for a chat request and
says what it cost; ``kvasird pay`` is it on the command line, and docs/market.md shows it
from Python. The functions below are the steps one by one, for a developer's own client
(any Solana wallet can pay), ``kvasird localnet``'s demo and tests.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import trio
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from kvasird.settlement.chain import ChainClient
from kvasird.settlement.errors import SettlementError
from kvasird.settlement.payments import Coverage, prepaid_message
from kvasird.settlement.token import format_kvr, transfer_instructions

PAYMENT_HEADER = "X-Kvasir-Payment"


def get_quote(
    gateway_url: str,
    max_tokens: int = 0,
    prompt_tokens: int = 0,
    request: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A quote for ``prompt_tokens`` in and ``max_tokens`` out, or for ``request`` itself
    (the body about to be sent: the gateway counts its prompt)."""
    body = (
        request
        if request is not None
        else {"max_tokens": max_tokens, "prompt_tokens": prompt_tokens}
    )
    resp = httpx.post(f"{gateway_url}/v1/kvasir/quote", json=body, timeout=30)
    resp.raise_for_status()
    return resp.json()


async def pay_quote(
    rpc_url: str, payer: Keypair, quote: dict[str, Any], commitment: str = "confirmed"
) -> str:
    """Transfer the quoted KVR to the vault with the quote's memo; return the header value."""
    ixs = transfer_instructions(
        payer.pubkey(),
        Pubkey.from_string(quote["vault"]),
        Pubkey.from_string(quote["mint"]),
        int(quote["amount"]),
        quote["memo"].encode(),
    )
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


class ConsumerError(SettlementError):
    """A paid request could not be made or was refused; the message says what to do, and
    whether the payment (if one was made) stays usable."""


@dataclass(frozen=True)
class Cost:
    """What one paid request cost, in KVR base units."""

    paid: int
    """The amount of the quote paid for it."""
    used: int
    """What its prompt and the tokens produced cost at the quote's prices."""
    returned: int
    """``paid - used``: credited to the payer's prepaid balance at the gateway, where it
    pays later requests (``Consumer`` spends it first)."""
    signature: str
    """The KVR transfer that paid it ("" when the prepaid balance paid it)."""
    header: str
    """The ``X-Kvasir-Payment`` value sent with the request."""


@dataclass(frozen=True)
class PaidAnswer:
    """A gateway's answer to a paid chat request."""

    text: str
    """The reply (the first choice's message)."""
    model: str
    """The model id that answered."""
    prompt_tokens: int
    """Tokens in the prompt, as the gateway counted them."""
    completion_tokens: int
    """Tokens produced."""
    cost: Cost
    """What it cost."""
    response: dict[str, Any]
    """The whole OpenAI chat completion object."""


class Consumer:
    """A wallet that pays a gateway per request: quote the request's own body, pay the
    quote (from the prepaid balance at the gateway when it holds enough, else by a KVR
    transfer on chain), send the request with the payment header. ``kvasird pay`` is this
    class on the command line."""

    def __init__(
        self,
        gateway_url: str,
        rpc_url: str,
        wallet: Keypair,
        *,
        commitment: str = "confirmed",
        timeout_s: float = 600.0,
    ) -> None:
        self.gateway = gateway_url.rstrip("/")
        self.rpc, self.wallet, self.commitment = rpc_url, wallet, commitment
        self._timeout = httpx.Timeout(30.0, read=timeout_s)

    async def ask(
        self,
        messages: str | list[dict[str, Any]],
        *,
        model: str = "",
        max_tokens: int = 256,
        payment: str = "",
        **params: Any,
    ) -> PaidAnswer:
        """A chat completion of ``messages`` (a string: one user message), paid. ``model``:
        any name the gateway accepts (default: its only model); ``params``: any other field
        of the OpenAI request (temperature, seed, ...); ``payment``: an unused
        ``X-Kvasir-Payment`` value to send instead of paying again (a request refused before
        any work leaves its payment usable)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        async with httpx.AsyncClient(base_url=self.gateway, timeout=self._timeout) as http:
            body = {
                "model": model or await self._only_model(http),
                "messages": messages,
                "max_tokens": max_tokens,
                **params,
            }
            quote = (await self._call(http, "POST", "/v1/kvasir/quote", "quote", json=body)).json()
            if payment:
                header, signature = payment, _transfer(payment)
            else:
                header, signature = await self._pay(http, quote)
            resp = await self._call(
                http,
                "POST",
                "/v1/chat/completions",
                "request",
                header,
                json=body,
                headers={PAYMENT_HEADER: header},
            )
        answer = resp.json()
        usage = answer["usage"]
        paid = int(resp.headers.get("x-kvasir-max-cost", quote["amount"]))
        prices = Coverage(
            paid,
            int(quote["prompt_tokens"]),
            int(quote["max_tokens"]),
            int(quote["price_per_1k_input_tokens"]),
            int(quote["price_per_1k_output_tokens"]),
        )
        choices = len(answer["choices"])
        used = min(prices.cost(choices * usage["prompt_tokens"], usage["completion_tokens"]), paid)
        return PaidAnswer(
            answer["choices"][0]["message"].get("content") or "",
            answer["model"],
            usage["prompt_tokens"],
            usage["completion_tokens"],
            Cost(paid, used, paid - used, signature, header),
            answer,
        )

    async def prepaid(self) -> int:
        """This wallet's prepaid balance at the gateway (what shorter answers left unused)."""
        async with httpx.AsyncClient(base_url=self.gateway, timeout=self._timeout) as http:
            return await self._prepaid(http)

    async def _prepaid(self, http: httpx.AsyncClient) -> int:
        got = await self._call(
            http, "GET", f"/v1/kvasir/balance/{self.wallet.pubkey()}", "prepaid balance"
        )
        return int(got.json()["prepaid"])

    async def _pay(self, http: httpx.AsyncClient, quote: dict[str, Any]) -> tuple[str, str]:
        """(header, transfer signature) paying ``quote``: from the prepaid balance if it
        covers it, else on chain after checking the wallet can."""
        owner = self.wallet.pubkey()
        if quote["vault"] == str(owner):
            raise ConsumerError(
                f"the gateway at {self.gateway} is paid into this very wallet ({owner}): it is "
                "your own, and its operator's requests from its machine need no payment "
                "(`kvasird chat`); pass --gateway of another node to pay it"
            )
        amount = int(quote["amount"])
        if await self._prepaid(http) >= amount:
            return prepaid_header(self.wallet, quote), ""
        async with ChainClient(self.rpc, self.commitment) as chain:
            held = await chain.token_balance(owner, Pubkey.from_string(quote["mint"]))
            sol = await chain.lamports(owner)
        if held < amount or sol == 0:
            raise ConsumerError(
                f"the wallet {owner} holds {format_kvr(held)} KVR and {sol} lamports of SOL; "
                f"this request costs {format_kvr(amount)} KVR and a transaction fee in SOL: "
                f"send it KVR and SOL (on a local chain: `kvasird wallet --address {owner} "
                f"--rpc {self.rpc} faucet`)"
            )
        header = await pay_quote(self.rpc, self.wallet, quote, self.commitment)
        return header, header.rpartition(":")[2]

    async def _only_model(self, http: httpx.AsyncClient) -> str:
        listed = (await self._call(http, "GET", "/v1/models", "model list")).json()["data"]
        if len(listed) != 1:
            names = ", ".join(str(m.get("name") or m["id"]) for m in listed) or "none yet"
            raise ConsumerError(
                f"the gateway at {self.gateway} serves {len(listed)} models ({names}): name one"
            )
        return str(listed[0]["id"])

    async def _call(
        self,
        http: httpx.AsyncClient,
        method: str,
        path: str,
        what: str,
        header: str = "",
        **kwargs: Any,
    ) -> httpx.Response:
        """The gateway's answer; its refusal as a ConsumerError in its own words (with the
        payment header, when a paid request was refused: it may still be usable)."""
        try:
            resp = await http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ConsumerError(
                f"the gateway at {self.gateway} cannot be reached ({exc}): "
                "check the URL, and that its node runs"
            ) from None
        if resp.status_code == 200:
            return resp
        try:
            reason = str(resp.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            reason = resp.text[:300]
        paid = f" (the payment sent: X-Kvasir-Payment: {header})" if header else ""
        raise ConsumerError(f"the gateway refused the {what} ({resp.status_code}): {reason}{paid}")


def _transfer(header: str) -> str:
    """The transfer signature of an ``X-Kvasir-Payment`` value ("" for a prepaid one)."""
    parts = header.split(":")
    return parts[1] if len(parts) == 2 else ""


def pay_and_ask(
    gateway_url: str,
    rpc_url: str,
    wallet: Keypair,
    messages: str | list[dict[str, Any]],
    **kwargs: Any,
) -> PaidAnswer:
    """``Consumer(gateway_url, rpc_url, wallet).ask(messages, **kwargs)`` outside trio."""
    return trio.run(
        functools.partial(Consumer(gateway_url, rpc_url, wallet).ask, messages, **kwargs)
    )
