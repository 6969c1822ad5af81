"""Numbers in grammar-held JSON are bounded in length (kvasird.text.grammar.bounded): a
sampled fraction ends, the documents still validate against the caller's schema, and a
schema's own bounds and data are kept."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher

from kvasird.compute.sampling import Sampler, SamplingParams
from kvasird.model.bundled import bundled_path
from kvasird.text.grammar import (
    DECIMALS,
    JSON_OBJECT,
    JSON_OPTIONS,
    SAFE_INTEGER,
    Constraint,
    GrammarError,
    bounded,
    for_json_schema,
    vocabulary,
)
from kvasird.text.tokenizer import Tokenizer
from kvasird.text.toolcalls.calls import Tool
from kvasird.text.toolcalls.registry import FORMATS

SCORE = {
    "type": "object",
    "properties": {
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "count": {"type": "integer"},
    },
    "required": ["score", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_path())


def follows(tok: Tokenizer, grammar: str, text: str) -> bool:
    """Whether ``text`` is a whole sentence of ``grammar``."""
    c = Constraint(vocabulary(tok), grammar)
    try:
        for t in tok.encode(text):
            c.consume(t)
    except GrammarError:
        return False
    return c.complete


def test_a_fraction_has_at_most_ten_digits_where_llguidance_alone_allows_any(tok) -> None:
    """The failure it fixes: a small model sampling a fraction wrote digits until max_tokens."""
    ten, eleven = "2." + "2" * DECIMALS, "2." + "2" * (DECIMALS + 1)
    grammar = for_json_schema(SCORE)
    assert follows(tok, grammar, f'{{"score": {ten}, "count": 1}}')
    assert not follows(tok, grammar, f'{{"score": {eleven}, "count": 1}}')
    raw = LLMatcher.grammar_from_json_schema(json.dumps(SCORE), defaults=JSON_OPTIONS)
    assert follows(tok, raw, f'{{"score": 2.{"2" * 80}, "count": 1}}')


def test_a_number_with_no_bound_of_its_own_stays_within_a_safe_integer(tok) -> None:
    grammar = for_json_schema(SCORE)
    assert follows(tok, grammar, f'{{"score": 1, "count": {SAFE_INTEGER}}}')
    assert follows(tok, grammar, f'{{"score": 1, "count": -{SAFE_INTEGER}}}')
    assert not follows(tok, grammar, f'{{"score": 1, "count": {SAFE_INTEGER + 1}}}')


def test_a_model_that_prefers_digits_still_ends_its_numbers(tok) -> None:
    """Logits that favour digits, as the small model's did once it was in a fraction: held
    to llguidance's own number grammar it writes digits until the limit; bounded, every
    document ends and validates."""
    schema = {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3}
    raw = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    digits = [t for d in "0123456789" for t in tok.encode(d)]

    def write(grammar: str, seed: int) -> list[int] | None:
        rng = np.random.default_rng(seed)
        sampler = Sampler(
            SamplingParams(temperature=1.0, seed=seed), Constraint(vocabulary(tok), grammar)
        )
        out: list[int] = []
        while len(out) < 120:
            logits = rng.normal(size=tok.n_vocab).astype(np.float32)
            logits[digits] += 12.0
            token = sampler(logits, out)
            if token in tok.special.end_of_generation:
                return out
            out.append(token)
        return None

    for seed in range(3):
        assert write(raw, seed) is None
        out = write(for_json_schema(schema), seed)
        assert out is not None
        jsonschema.validate(json.loads(tok.decode(out)), schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        {"enum": [3.14159265358979, 2.718281828459045]},
        {"type": "object", "properties": {"pi": {"const": 3.14159265358979}}},
        {"type": "integer", "minimum": 10**20},
        {"type": "string"},
    ],
    ids=["own-bounds", "enum", "const", "beyond-safe", "no-number"],
)
def test_a_schemas_own_bounds_and_data_are_kept(schema: dict[str, Any]) -> None:
    assert bounded(schema) == schema


def test_nested_and_listed_numbers_are_bounded_and_only_they() -> None:
    schema = {
        "type": "object",
        "properties": {
            "at": {"type": "array", "items": {"type": ["number", "null"]}},
            "n": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "string"}]},
        },
    }
    at = bounded(schema)["properties"]["at"]["items"]
    assert at == {
        "type": ["number", "null"],
        "minimum": -SAFE_INTEGER,
        "maximum": SAFE_INTEGER,
        "multipleOf": 10.0**-DECIMALS,
    }
    n = bounded(schema)["properties"]["n"]["anyOf"]
    assert n == [
        {"type": "integer", "exclusiveMinimum": 0, "maximum": SAFE_INTEGER},
        {"type": "string"},
    ]


def test_a_tools_numeric_arguments_are_bounded_too(tok) -> None:
    tool = Tool(
        "set_level",
        "",
        {
            "type": "object",
            "properties": {"level": {"type": "number"}},
            "required": ["level"],
            "additionalProperties": False,
        },
    )
    grammar = FORMATS["hermes"].grammar([tool])
    call = '<tool_call>\n{{"name": "set_level", "arguments": {{"level": {}}}}}\n</tool_call>'
    assert follows(tok, grammar, call.format("0." + "5" * DECIMALS))
    assert not follows(tok, grammar, call.format("0." + "5" * (DECIMALS + 1)))


def test_json_object_takes_any_object_with_its_numbers_bounded(tok) -> None:
    grammar = for_json_schema(JSON_OBJECT)
    assert follows(tok, grammar, '{"a": [1, {"b": -2.5, "c": null}], "d": "x", "e": true}')
    assert follows(tok, grammar, "{}")
    assert not follows(tok, grammar, "[1]")
    assert not follows(tok, grammar, '{"a": 0.' + "5" * (DECIMALS + 1) + "}")
