"""Grammar-constrained decoding: the output of a request follows a grammar, token by token.

The engine is llguidance (the Rust library llama.cpp builds for JSON schemas, also used by
vLLM and SGLang), through its Python wheel: it compiles JSON schemas, Lark and regular
expressions into one grammar form, and computes the mask of allowed tokens for the next
position in a small fraction of a decode step (bench/bench_grammar.py measures it on the
bundled model's 49k vocabulary), with no tokenizer of its own to
agree with: it is given ours, token by token.

    gateway   response_format (json_object | json_schema) ─► grammar text (``for_json_schema``),
              checked once (``check``) so that a bad schema is a 400 naming it
    wire      SamplingParams.grammar travels with the sampling settings to the head
    head      the stage that samples builds a ``Constraint`` for the session:
                  vocabulary(tokenizer) ─► LLTokenizer (built once per model, ~0.13 s)
                  Constraint.allowed(generated) ─► the mask the Sampler applies
                  Constraint.consume(token)     ◄─ what it drew
              A replay after failover hands the new head the generated tokens as history:
              ``allowed`` consumes those it has not seen first, so the constraint is where
              the old head's was, and greedy output continues exactly.

When the grammar is complete, only the end-of-generation tokens are allowed: the model's
EOS ends the reply, with finish reason "stop". A reply cut by max_tokens is cut mid-way,
as with OpenAI's API.

Every JSON document a grammar allows has a bounded length where its schema bounds its
strings and arrays: the whitespace between tokens is bounded (``JSON_OPTIONS``), and so are
numbers (``bounded``). Left to llguidance's defaults, a number may take any count of digits,
and a small model sampling a fraction writes digits until max_tokens
(``2.2222226384560329784...``), which is what kept strict schemas from validating.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from kvasird.compute.errors import InputError
from kvasird.text.tokenizer import Tokenizer


class GrammarError(InputError):
    """A grammar (or the schema it came from) cannot be used; at the head, a request's
    input error like any other (the stage refuses the step as "bad")."""


def for_json_schema(schema: Any, what: str = "schema") -> str:
    """The grammar of JSON documents that validate against ``schema`` (a dict)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON Schema object")
    try:
        return _grammar(bounded(schema))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{what} is not a JSON Schema this server can follow: {exc}") from None


def json_part(schema: dict[str, Any]) -> str:
    """``schema`` as a ``%json`` part of a Lark grammar (a tool's arguments), held to the
    same whitespace and numbers as a whole document."""
    return f"%json {json.dumps({**bounded(schema), 'x-guidance': JSON_OPTIONS})}"


JSON_OPTIONS: Any = {"whitespace_pattern": r"( |\n[ \t]{0,20})?"}
"""Between JSON tokens: nothing, a space, or a newline and up to 20 indents (llama.cpp's
rule for its JSON-schema grammars): room for pretty-printing, and an end. Any whitespace
(llguidance's default) let a model pad a document until max_tokens."""

_VALUE = {"$ref": "#/$defs/value"}
JSON_OBJECT = {
    "type": "object",
    "additionalProperties": _VALUE,
    "$defs": {
        "value": {
            "type": ["null", "boolean", "number", "string", "array", "object"],
            "items": _VALUE,
            "additionalProperties": _VALUE,
        }
    },
}
"""OpenAI's ``json_object``: any JSON object. Its values are spelled out (rather than
``{"type": "object"}``) so that ``bounded`` finds their numbers."""

SAFE_INTEGER = 2**53 - 1
"""The largest magnitude a number may have where its schema sets no bound: every integer up
to it is exact in a double (JavaScript's ``Number.MAX_SAFE_INTEGER``), so any client reads
the number as written; at most 16 digits before the point."""

DECIMALS = 10
"""The most digits a number may have after its point where its schema sets no
``multipleOf``: the finest step llguidance's ``multipleOf`` holds exactly (a finer one
is refused as having too many digits)."""

_DATA = frozenset({"const", "enum", "default", "examples"})
"""Schema keywords whose values are JSON data, not schemas: their numbers are left alone."""


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every number it allows bounded in length: ``SAFE_INTEGER`` where it
    sets no minimum or maximum, ``DECIMALS`` where it sets no ``multipleOf``. Each document
    the bounded schema allows is one the schema allows. Where the bounds leave nothing to
    write (a schema whose own range lies beyond them), ``schema`` is kept as it is."""
    tight = _bound(schema)
    if tight == schema:
        return schema
    error = LLMatcher.validate_grammar(_grammar(tight))
    return schema if error and not error.startswith("WARNING") else tight


def _bound(node: Any) -> Any:
    if isinstance(node, list):
        return [_bound(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA else _bound(v) for k, v in node.items()}
    kinds = out.get("type")
    types = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if types & {"number", "integer"}:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    if "number" in types and "multipleOf" not in out:
        out["multipleOf"] = 10.0**-DECIMALS
    return out


def _grammar(schema: dict[str, Any]) -> str:
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


def check(grammar: str, what: str = "grammar") -> None:
    """Raise GrammarError unless ``grammar`` compiles (the head would refuse it later)."""
    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"{what}: {error[:300]}")


_vocabularies: dict[int, tuple[Tokenizer, LLTokenizer]] = {}
_lock = threading.Lock()


def vocabulary(tokenizer: Tokenizer) -> LLTokenizer:
    """llguidance's view of a model's vocabulary (cached per tokenizer object)."""
    with _lock:
        hit = _vocabularies.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:
            hit = _vocabularies[id(tokenizer)] = (
                tokenizer,
                LLTokenizer(
                    TokenizerWrapper(_Vocab(tokenizer)),
                    eos_token=sorted(tokenizer.special.end_of_generation) or None,
                ),
            )
        return hit[1]


class _Vocab:
    """A tokenizer as llguidance's TokenizerWrapper reads one: each token's bytes (special
    tokens marked with a leading 0xff, as llguidance expects), and an encoder."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tokenizer = tok
        self.eos_token_id = tok.special.eos
        self.bos_token_id = tok.special.bos
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [
            b"\xff" + tok.token_bytes(i) if i in special else tok.token_bytes(i)
            for i in range(tok.n_vocab)
        ]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self.tokenizer.encode(text)


class Constraint:
    """One generation's grammar state (kvasird.compute.sampling.Constraint)."""

    def __init__(self, vocab: LLTokenizer, grammar: str) -> None:
        self._matcher = LLMatcher(vocab, grammar)
        if self._matcher.is_error():
            raise GrammarError(f"grammar: {self._matcher.get_error()[:300]}")
        self._n = vocab.vocab_size
        self._end = np.zeros(self._n, bool)
        self._end[[t for t in vocab.eos_tokens if 0 <= t < self._n]] = True
        self.consumed = 0
        """Output tokens the grammar has seen."""

    def allowed(self, generated: Any) -> np.ndarray:
        for token in generated[self.consumed :]:
            self.consume(int(token))
        if self._matcher.is_stopped():  # complete, its end drawn: only an end again
            return self._end.copy()
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self._n].astype(bool)
        if not mask.any():
            raise GrammarError(
                f"the grammar allows no token here: "
                f"{self._matcher.get_error()[:200] or 'it is complete'}"
            )
        return mask

    def consume(self, token: int) -> None:
        if self._matcher.is_stopped() and self._end[token]:
            self.consumed += 1
            return
        if not self._matcher.consume_token(token):
            raise GrammarError(
                f"token {token} does not follow the grammar: {self._matcher.get_error()[:200]}"
            )
        self.consumed += 1

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return self._matcher.is_accepting()
