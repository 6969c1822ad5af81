"""Prefix reuse through real daemons, seen with the official openai client: a request that
starts like an earlier one (an agent's system prompt, sent again on every call) starts from
the stages' kept KV (usage.prompt_tokens_details.cached_tokens), computes the logprobs a
cold route computes, bit for bit; and a gateway sends it to the replica that holds that
start, not to the one it would otherwise take."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from test_swarm import ROUTED_S, routable, settings, start  # type: ignore[import-not-found]

from kvasird.compute.kv.keys import PAGE
from kvasird.inference.client.swarm import PREFILL_CHUNK
from kvasird.localnet import LocalNet
from kvasird.model.bundled import bundled_path

pytestmark = pytest.mark.slow

SYSTEM = " ".join(f"Rule {i}: answer the user in a short sentence about item {i * 7 % 13}, "
                  f"never mention the colour {['red', 'green', 'blue'][i % 3]}." for i in range(30))
"""A long system prompt (~700 tokens), the same on every call."""


def ask(client: openai.OpenAI, question: str) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2, messages=[{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": question}])


def logprobs(reply: Any) -> list[tuple[str, float, list[float]]]:
    return [(t.token, t.logprob, [a.logprob for a in t.top_logprobs])
            for t in reply.choices[0].logprobs.content]


def client_of(net: LocalNet, index: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=net.nodes[index].status()["gateway"] + "/v1",
                         api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ring(module_tmp: Callable[[str], Path]) -> Iterator[LocalNet]:
    net = LocalNet(module_tmp("ring"), 3)
    with net:
        yield start(lambda n: net, bundled_path(), [["head", "layers:0-10"], ["layers:10-20"],
                                                   ["layers:20-30"]])


def test_a_repeated_prompt_starts_from_the_kept_kv_and_computes_the_same_logprobs(
        ring: LocalNet) -> None:
    net = ring
    gateway = client_of(net, 0)
    first = ask(gateway, "What is item 3?")
    n_prompt = first.usage.prompt_tokens
    assert n_prompt > 4 * PAGE and first.usage.prompt_tokens_details.cached_tokens == 0
    again = ask(gateway, "What is item 3?")
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert n_prompt - PAGE <= cached < n_prompt and cached % PAGE == 0, (cached, n_prompt)
    assert logprobs(again) == logprobs(first)  # bit for bit, text and all
    # another question after the same system prompt: the cold answer of another gateway
    # (a caller of its own: nothing kept for it) on the same stages, bit for bit. A hop
    # that answers a prefill chunk late (a loaded machine) fails the route over, and the
    # new route starts from the pages the hops kept of that same request's first chunks:
    # then the third node's gateway gives the cold answer.
    other = ask(gateway, "Which colour is never mentioned for item 5?")
    assert other.usage.prompt_tokens_details.cached_tokens >= 256
    for index in (1, 2):
        cold = ask(client_of(net, index), "Which colour is never mentioned for item 5?")
        if cold.usage.prompt_tokens_details.cached_tokens == 0:
            break
    # Still reused: only its own first chunks, kept by its failed first route (a whole
    # chunk, never the other caller's system-prompt pages, which are more).
    own = cold.usage.prompt_tokens_details.cached_tokens
    assert own % PREFILL_CHUNK == 0 and own < other.usage.prompt_tokens_details.cached_tokens
    assert logprobs(other) == logprobs(cold)
    # every stage of the route started from its kept pages, seen on each node
    status = [n.get("/v0/inference")["prefix"] for n in net.nodes]
    reused = cached + other.usage.prompt_tokens_details.cached_tokens
    assert status[0]["reused_tokens"] == reused
    assert all(s["reused_pages"] >= reused // PAGE for s in status), status
    assert all(s["kept_pages"] > 0 for s in status)


def test_the_gateway_sends_a_known_prefix_to_the_replica_that_holds_it(
        localnet: Callable[..., LocalNet]) -> None:
    """Node 0 holds nothing; nodes 1 and 2 each hold the whole model. After the first
    request the replica it went to has a measured step time while the other has only its
    heartbeat RTT (far less on loopback), so the cheapest route is the other replica: the
    prefix's keeps the request where its start is."""
    model = bundled_path()
    net = localnet(3)
    previous = ""
    for node, pins in zip(net.nodes, [[], ["head", "layers:0-30"], ["head", "layers:0-30"]],
                          strict=True):
        net.settings = {**net.settings, **settings(model, pins)}
        previous = net.configure(node, [previous] if previous else [])
    for node in net.nodes:
        node.spawn()
    for node in net.nodes:
        node.wait_ready()

    def both_replicas() -> bool:
        holders = net.nodes[0].get("/v0/coverage").get("holders") or {}
        return sum(bool(h["holdings"]) and all(x[-1] == "online" for x in h["holdings"])
                   for h in holders.values()) == 2

    net.wait_until("the gateway sees both replicas online", both_replicas, ROUTED_S)
    net.wait_until("the gateway has a route", lambda: routable(net.nodes[0]), ROUTED_S)
    gateway = client_of(net, 0)
    replicas = net.nodes[1:]

    def reused() -> list[int]:
        return [n.get("/v0/inference")["prefix"]["reused_pages"] for n in replicas]

    before = reused()
    ask(gateway, "What is item 3?")
    for question in ("What is item 4?", "What is item 5?", "What is item 6?"):
        assert ask(gateway, question).usage.prompt_tokens_details.cached_tokens >= 256
    gained = [b - a for a, b in zip(before, reused(), strict=True)]
    assert sorted(gained)[0] == 0 and sorted(gained)[1] >= 3 * 256 // PAGE, gained
