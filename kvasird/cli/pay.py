"""``kvasird pay``: ask a gateway one question and pay for it from a wallet.

Quote → payment → request, as ``kvasird.settlement.consumer.Consumer`` does it: the
request's own body is quoted, the quote is paid from the wallet's prepaid balance at the
gateway when that covers it, else by a KVR transfer on chain, and the request goes out
with the payment header. The answer goes to stdout; what it cost (paid, used, returned
to the prepaid balance) to stderr, so that the answer alone can be piped on.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import trio

from kvasird.cli.chat import daemon_gateway
from kvasird.cli.wallet import keypair_path, rpc_and_mint
from kvasird.settlement.consumer import Consumer, PaidAnswer
from kvasird.settlement.token import format_kvr
from kvasird.settlement.wallet import read_keypair


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pay", help="ask a gateway one question and pay for it in KVR")
    p.add_argument("prompt", help="what to ask")
    p.add_argument(
        "--gateway",
        dest="url",
        default="",
        help="gateway URL (default: the running daemon's gateway)",
    )
    p.add_argument(
        "--model", default="", help="model name, slug or id (default: the gateway's only model)"
    )
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--wallet",
        dest="keypair",
        type=Path,
        default=None,
        metavar="FILE",
        help="the paying keypair file (default: [settlement] wallet, else <home>/wallet.json)",
    )
    p.add_argument(
        "--rpc",
        default="",
        metavar="URL",
        help="Solana JSON-RPC URL (default: [settlement] rpc_url, else the local "
        "chain's 127.0.0.1:8899)",
    )
    p.add_argument(
        "--payment",
        default="",
        metavar="HEADER",
        help="an unused X-Kvasir-Payment value to send instead of paying again "
        "(a request refused before any work leaves its payment usable)",
    )
    p.set_defaults(func=_run, address="", mint="")  # what `kvasird wallet`'s lookups read


def _run(args: argparse.Namespace) -> int:
    wallet = read_keypair(keypair_path(args))
    url = args.url or daemon_gateway(args, "--gateway")
    consumer = Consumer(url, rpc_and_mint(args)[0], wallet)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    answer: PaidAnswer = trio.run(
        functools.partial(
            consumer.ask,
            messages,
            model=args.model,
            max_tokens=args.max_tokens,
            payment=args.payment,
            temperature=args.temperature,
            seed=args.seed,
        )
    )
    print(answer.text)
    cost = answer.cost
    how = f"transaction {cost.signature}" if cost.signature else "from your prepaid balance"
    say(f"paid      {format_kvr(cost.paid)} KVR ({how})")
    say(
        f"used      {format_kvr(cost.used)} KVR ({answer.prompt_tokens} prompt and "
        f"{answer.completion_tokens} output tokens of {answer.model[:12]})"
    )
    say(
        f"returned  {format_kvr(cost.returned)} KVR to your prepaid balance at {url} (it "
        "pays your next requests there)"
    )
    return 0


def say(text: str) -> None:
    """A line about the payment, not the answer: on stderr."""
    print(text, file=sys.stderr, flush=True)
