"""The engine's own greedy answer: what a gateway test compares the gateway's text with
(imported by name, like gateway_daemon).

Where a step's top two logits are close, the CPU's kernels pick the greedy token: after
"You are a helpful assistant." the bundled model's first token wins by 0.13 on one AVX2
machine and loses on others, so no fixed answer is right on every machine. The engine on
the same token ids, on this machine, is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.sampling import Sampler, SamplingParams
from kvasird.compute.stage import Stage, generate
from kvasird.model.bundled import bundled_path
from kvasird.text.chat import ChatTemplate, Message
from kvasird.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Greedy:
    text: str
    """The decoded answer, without the end-of-generation token."""
    tokens: int
    """Its length in tokens (what usage reports)."""
    stopped: bool
    """It ended with an end-of-generation token rather than at max_tokens."""


def greedy(
    messages: Sequence[Message], max_tokens: int, params: SamplingParams | None = None
) -> Greedy:
    """The bundled model's greedy answer to ``messages`` rendered as the gateway renders them
    (``params``: a logit bias, penalties).

    The KV cache is F16 like the daemon's; its size does not change the numbers (attention
    always gathers whole buckets of slots)."""
    tok = Tokenizer.from_gguf(bundled_path())
    prompt = tok.encode(ChatTemplate.of(tok).render(messages), special=True)
    stops = tok.special.end_of_generation
    stage = Stage.load(bundled_path(), threads=1, kv=KVSpec(n_slots=1024))
    try:
        out = generate(stage, prompt, max_tokens, Sampler(params or SamplingParams()), stop=stops)
    finally:
        stage.close()
    kept = [t for t in out if t not in stops]
    return Greedy(tok.decode(kept), len(kept), len(kept) < len(out))


def cut(text: str) -> tuple[str, str, str]:
    """``text`` as (before, stop, after): stop is its third and fourth words, a stop sequence
    that crosses a token boundary and occurs first where it is cut."""
    words = text.split(" ")
    assert len(words) >= 5, f"the answer is too short to cut: {text!r}"
    stop = " ".join(words[2:4])
    before = text[: text.index(stop)]
    return before, stop, text[len(before) + len(stop):]
