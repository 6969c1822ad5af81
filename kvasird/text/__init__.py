"""Text: what turns a request's text into token ids and the generated ids back into text.

The engine and the swarm see token ids only (``kvasird.inference``); text lives at the edges,
here, used by whoever speaks to people: the gateway, the CLI, the benchmarks.

    tokenizer   the model's tokenizer from the GGUF (byte-level BPE through HF tokenizers, or
                SentencePiece), and streaming-safe decoding (a character may span tokens)
    spm         SentencePiece vocabularies, encoded as llama.cpp encodes them
    chat        the GGUF's chat template, rendered in Jinja's sandbox: messages -> prompt text
    grammar     grammar-constrained decoding: JSON schemas and Lark compiled by llguidance,
                and the per-session Constraint the head's sampler applies
    toolcalls/  tool calls, one module per family's format behind a registry: tools into the
                prompt, the model's calls out of its text (whole, or as it streams)

Data flow of one chat request:

    messages, tools ─chat (toolcalls: the tools and past calls in the family's words)─▶
        prompt text ─tokenizer─▶ ids ─▶ inference (ids only; grammar: the head's Constraint)
        ─▶ generated ids ─tokenizer (StreamDecoder)─▶ text ─toolcalls (Reader)─▶
        Said / CallOpened / Args / CallClosed / Thought ─▶ the gateway's reply
"""
