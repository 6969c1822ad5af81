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
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{what} is not a JSON Schema this server can follow: {exc}") from None


JSON_OPTIONS: Any = {"whitespace_pattern": r"( |\n[ \t]{0,20})?"}
"""Between JSON tokens: nothing, a space, or a newline and up to 20 indents (llama.cpp's
rule for its JSON-schema grammars): room for pretty-printing, and an end. Any whitespace
(llguidance's default) let a model pad a document until max_tokens."""

JSON_OBJECT = {"type": "object"}
"""OpenAI's ``json_object``: any JSON object."""


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
