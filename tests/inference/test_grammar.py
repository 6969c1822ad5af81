"""Grammar-constrained decoding: llguidance's masks at the sampler, on real vocabularies and
real engines (the bundled model whole, and the in-process forwarded route with a failover)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
import trio

from kvasird.compute.sampling import Sampler, SamplingParams
from kvasird.inference.api import Finished, GenerationRequest, Sampling, TokenEvent
from kvasird.inference.local import LocalGenerator
from kvasird.inference.server.engine import Served
from kvasird.model.bundled import bundled_path
from kvasird.text.grammar import (
    JSON_OBJECT,
    Constraint,
    GrammarError,
    check,
    for_json_schema,
    vocabulary,
)
from kvasird.text.tokenizer import Tokenizer

from .conftest import PROMPT
from .fakenet import FakeNet
from .test_swarm import at_token, token_events

CHOICE = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}
"""A schema whose documents are few and short: random logits finish it quickly."""


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_path())


GREEDY = SamplingParams()


def draw(tok: Tokenizer, grammar: str, seed: int, params: SamplingParams = GREEDY,
         limit: int = 200) -> tuple[str, list[int]]:
    """Sample from random logits under ``grammar`` until an end-of-generation token."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(params, Constraint(vocabulary(tok), grammar))
    out: list[int] = []
    for _ in range(limit):
        token = sampler(rng.normal(size=tok.n_vocab).astype(np.float32), out)
        if token in tok.special.end_of_generation:
            return tok.decode(out), out
        out.append(token)
    raise AssertionError(f"no end within {limit} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "seeded"])
def test_random_logits_under_a_schema_give_documents_that_validate(tok, params) -> None:
    grammar = for_json_schema(CHOICE)
    seen = set()
    for seed in range(8):
        text, _ = draw(tok, grammar, seed, params)
        jsonschema.validate(json.loads(text), CHOICE)
        seen.add(text)
    assert len(seen) > 1  # the logits chose, within what the grammar allows


def test_a_constraint_catches_up_on_tokens_it_did_not_draw(tok) -> None:
    """A failover's new head sees the generated tokens as history: it consumes them first,
    and then allows exactly what the old head's constraint allowed."""
    grammar = for_json_schema(CHOICE)
    _, tokens = draw(tok, grammar, 0)
    old = Constraint(vocabulary(tok), grammar)
    for t in tokens[:3]:
        old.allowed(tokens[:old.consumed])
        old.consume(t)
    new = Constraint(vocabulary(tok), grammar)
    assert np.array_equal(new.allowed(tokens[:3]), old.allowed(tokens[:3]))
    assert new.consumed == old.consumed == 3


def test_json_object_allows_any_object_and_only_an_object(tok) -> None:
    text, _ = draw(tok, for_json_schema(JSON_OBJECT), 1, limit=2000)
    assert isinstance(json.loads(text), dict)


def test_a_token_outside_the_grammar_and_bad_schemas_are_errors(tok) -> None:
    c = Constraint(vocabulary(tok), for_json_schema(CHOICE))
    assert not c.allowed([])[tok.encode("hello")[0]]
    with pytest.raises(GrammarError, match="does not follow the grammar"):
        c.consume(tok.encode("hello")[0])
    with pytest.raises(GrammarError, match="JSON Schema object"):
        for_json_schema(["not", "a", "schema"])
    with pytest.raises(GrammarError):
        check(for_json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))


def test_the_whole_bundled_model_answers_in_the_schema(tok) -> None:
    """The real engine, greedy: the prompt asks for something else; the output is the schema's."""
    generator = LocalGenerator.open(bundled_path(), "m", "bundled", threads=1, kv_tokens=512)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    prompt = tok.encode("<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n",
                        special=True)
    request = GenerationRequest("m", tuple(prompt), Sampling(
        SamplingParams(grammar=for_json_schema(schema)), 60),
        stop_tokens=tok.special.end_of_generation)

    async def run() -> tuple[list[int], str]:
        out, reason = [], ""
        async for event in generator.generate(request):
            if isinstance(event, TokenEvent):
                out.append(event.token)
            elif isinstance(event, Finished):
                reason = event.reason
        return out, reason

    try:
        tokens, reason = trio.run(run)
    finally:
        generator.close()
    assert reason == "stop"
    jsonschema.validate(json.loads(tok.decode(tokens)), schema)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
async def test_a_failover_mid_document_continues_the_same_document(
        served: dict[str, Served], seeded: bool) -> None:
    """b dies after 5 tokens of a constrained generation; the new route's head rebuilds the
    grammar's state from the replayed history: the tokens are the undisturbed run's."""
    grammar = for_json_schema(CHOICE)
    params = SamplingParams(temperature=0.8, seed=11, grammar=grammar) if seeded else \
        SamplingParams(grammar=grammar)

    vocab = Tokenizer.from_gguf(served["gw"].sources[0])

    async def tokens(net: FakeNet, on_token: Any = None) -> list[int]:
        req = GenerationRequest("m", tuple(PROMPT), Sampling(params, 150),
                                stop_tokens=vocab.special.end_of_generation)
        return [e.token for e in await token_events(net, req, on_token)]

    undisturbed = await tokens(FakeNet(served))
    net = FakeNet(served)
    replayed = await tokens(net, at_token(5, lambda: net.down.add("b")))
    assert "b" in net.down and replayed == undisturbed
    jsonschema.validate(json.loads(vocab.decode(undisturbed)), CHOICE)  # ended, and valid
