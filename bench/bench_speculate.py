"""Speculative decoding where it should not pay: one node, and a 3-stage ring on loopback.

    .venv/bin/python bench/bench_speculate.py [--tokens 96] [--rounds 12]

On loopback a step is mostly compute, so a guessed row costs about what it saves and the
adaptive k should fall to 0 (kvasird.inference.client.speculate). This checks that it
never makes a generation slower: for each layout, two local networks of real daemons run
side by side (the same placement, bench_swarm.start), one with ``[inference] speculate =
"off"``, the other with the default ``"auto"`` (prompt lookup, k from the measurements),
and each round generates on one, then on the other, the order swapped every round (greedy,
--tokens tokens, through the admin API's token stream): the ratio of each pair is taken
under the same machine load, and the table gives their median. A row with no guesses shows
the noise of the machine: both networks then do the same work. Two prompts: a question
(lookup finds little) and an editing request whose answer repeats its text (lookup finds
much). The guesses made and accepted come from the gateway's admin API. The closing line:

    speculate-loopback: worst D.DDx (auto over off; the issue asks >= 0.97x)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_swarm import _stamps, start  # noqa: E402

from kvasird.localnet.launcher import LocalNode  # noqa: E402
from kvasird.logs import configure  # noqa: E402
from kvasird.model.bundled import bundled_path  # noqa: E402
from kvasird.text.chat import ChatTemplate, Message  # noqa: E402
from kvasird.text.tokenizer import Tokenizer  # noqa: E402

LAYOUTS = {
    "1 node": [["head", "layers:0-30"]],
    "3-stage ring": [["head", "layers:0-10"], ["layers:10-20"], ["layers:20-30"]],
}
TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. Time flies like an arrow; fruit flies like a banana."
)
PROMPTS = {
    "question": "What is the capital of France? Answer in one paragraph.",
    "edit": f"Copy this text exactly, word for word, then stop:\n\n{TEXT}",
}


def rate(node: LocalNode, prompt: list[int], n: int) -> float:
    """Decode tok/s of one greedy generation, between its first and last token events."""
    stamps = _stamps(node, prompt, n)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def speculation(node: LocalNode) -> tuple[int, int]:
    """(guessed, accepted) by the node's gateway since it started."""
    spent = node.get("/v0/inference").get("speculation", {})
    return int(spent.get("guessed", 0)), int(spent.get("accepted", 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96, help="tokens a generation")
    ap.add_argument("--rounds", type=int, default=12, help="pairs (off, auto) per row")
    ap.add_argument("--threads", type=int, default=1, help="compute threads a daemon")
    args = ap.parse_args()
    configure("warning", json=False)
    model = bundled_path()
    tok = Tokenizer.from_gguf(model)
    template = ChatTemplate.of(tok)
    prompts = {
        name: tok.encode(template.render([Message("user", text)]), special=True)
        for name, text in PROMPTS.items()
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout, placement in LAYOUTS.items():
            root = Path(tmp) / layout.replace(" ", "-")
            modes = {"off": {"inference.speculate": "off"}, "auto": {}}
            nets = {m: start(root / m, model, placement, args.threads, x)
                    for m, x in modes.items()}
            try:
                off, auto = nets["off"].nodes[0], nets["auto"].nodes[0]
                for name, prompt in prompts.items():
                    rate(off, prompt, args.tokens), rate(auto, prompt, args.tokens)  # warm
                    before = speculation(auto)
                    pairs = []
                    for i in range(args.rounds):  # off first, then auto first: drift cancels
                        if i % 2:
                            b, a = rate(auto, prompt, args.tokens), rate(off, prompt, args.tokens)
                        else:
                            a, b = rate(off, prompt, args.tokens), rate(auto, prompt, args.tokens)
                        pairs.append((a, b))
                    after = speculation(auto)
                    guessed, accepted = after[0] - before[0], after[1] - before[1]
                    rows.append((layout, name, pairs, guessed, accepted))
                    print(f"{layout}, {name}: done", flush=True)
            finally:
                for net in nets.values():
                    net.__exit__(None, None, None)
    print(
        f"\n## Speculation on loopback: auto over off (greedy, {args.tokens} tokens, "
        f"{args.threads} thread(s) a daemon; medians of {args.rounds} pairs)\n"
    )
    print("| layout | prompt | off tok/s | auto tok/s | auto / off | accepted / guessed |")
    print("|---|---|---|---|---|---|")
    worst = float("inf")
    for layout, name, pairs, guessed, accepted in rows:
        ratio = statistics.median(b / a for a, b in pairs if a > 0)
        worst = min(worst, ratio)
        print(
            f"| {layout} | {name} | {statistics.median(a for a, _ in pairs):.1f} | "
            f"{statistics.median(b for _, b in pairs):.1f} | {ratio:.2f}x | "
            f"{accepted} / {guessed} |"
        )
    print(f"\nspeculate-loopback: worst {worst:.2f}x (auto over off; the issue asks >= 0.97x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
