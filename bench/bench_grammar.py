"""Decode tokens/s with and without a JSON-schema constraint, on the bundled model whole.

    .venv/bin/python bench/bench_grammar.py [--threads 1] [--rounds 7] [--tokens 64]

Each round decodes --tokens greedy tokens after the same chat prompt twice, unconstrained
and under a schema (one string field of up to 400 characters, so the document does not
end before the count), alternating which goes first; 'ratio' is the median of the
rounds' constrained/unconstrained tokens/s. The mask's own cost per token is timed apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvasird.compute.sampling import Sampler, SamplingParams
from kvasird.compute.stage import Stage
from kvasird.model.bundled import bundled_path
from kvasird.text.grammar import Constraint, for_json_schema, vocabulary
from kvasird.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 400}},
          "required": ["story"], "additionalProperties": False}


def decode(stage: Stage, prompt: list[int], n: int, sampler: Sampler) -> tuple[float, list[int]]:
    history, out = list(prompt), []
    with stage.open_session() as s:
        logits = stage.forward(s, np.asarray(prompt))[-1]
        began = time.perf_counter()
        for _ in range(n):
            token = sampler(logits, history)
            out.append(token)
            history.append(token)
            logits = stage.forward(s, np.array([token]))[-1]
        return n / (time.perf_counter() - began), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    tok = Tokenizer.from_gguf(bundled_path())
    stage = Stage.load(bundled_path(), threads=args.threads)
    prompt = tok.encode("<|im_start|>user\nTell me a story as JSON.<|im_end|>\n"
                        "<|im_start|>assistant\n", special=True)
    grammar = for_json_schema(SCHEMA)
    vocab = vocabulary(tok)
    free, bound, ratios = [], [], []
    for r in range(args.rounds):
        runs = {}
        for kind in (("free", "bound") if r % 2 == 0 else ("bound", "free")):
            sampler = Sampler(SamplingParams()) if kind == "free" else \
                Sampler(SamplingParams(), Constraint(vocab, grammar), len(prompt))
            runs[kind], out = decode(stage, prompt, args.tokens, sampler)
            if kind == "bound":
                text = tok.decode(out)
                assert text.startswith('{') and '"story"' in text, text
        free.append(runs["free"])
        bound.append(runs["bound"])
        ratios.append(runs["bound"] / runs["free"])
    masks = []
    c = Constraint(vocab, grammar)
    story = tok.encode('{"story": "' + "once upon a time " * 20)
    for t in story:
        began = time.perf_counter()
        c.allowed([])
        masks.append((time.perf_counter() - began) * 1000)
        c.consume(t)
    stage.close()
    print(f"bundled model, {args.threads} thread(s), {args.tokens} greedy tokens, "
          f"{args.rounds} rounds")
    print(f"{'decode':<28} {'tok/s p50':>10}")
    print(f"{'unconstrained':<28} {statistics.median(free):>10.1f}")
    print(f"{'JSON schema (llguidance)':<28} {statistics.median(bound):>10.1f}")
    print(f"ratio constrained/unconstrained, median of rounds: {statistics.median(ratios):.3f}")
    print(f"mask per token: median {statistics.median(masks):.3f} ms, max {max(masks):.3f} ms "
          f"({len(masks)} positions inside a string)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
