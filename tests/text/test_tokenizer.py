"""The GGUF tokenizer and chat template of the bundled SmolLM2 model.

llama.cpp is not built here, so ids are checked against a from-the-definition BPE
written in this file (llama.cpp's "smollm" split, GPT-2 bytes, merge ranks from the
GGUF), against what the vocabulary itself implies (a word that is one vocabulary entry
is one token), and by round trips over varied text.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import regex

from kvasird.model.bundled import bundled_path
from kvasird.model.gguffile import read_header
from kvasird.text.chat import ChatTemplate, ChatTemplateError, Message
from kvasird.text.tokenizer import Tokenizer, TokenizerError, _unicode_to_byte

TEXTS = [
    "Hello world", "What is the capital of France?", "  leading and trailing spaces  ",
    "tabs\tand\nnew\nlines\n\n\n", "def fibonacci(n):\n    return n if n < 2 else fib(n - 1)\n",
    "numbers 1234567890 and 3.14159, -42", "héllo wörld — “quotes” ‘single’ …", "日本語のテキスト",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷", "Ελληνικά и русский текст", "مرحبا بالعالم",
    "<html><body class=\"x\">&amp;</body></html>", "SELECT * FROM users WHERE id = 1;",
    "don't won't they're I'm we've you'll he'd", "\u200b zero width \ufeff bom", "a" * 300,
    "<|im_start|> is only text here", "mixed\r\nline\rendings",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_path())


@pytest.mark.parametrize("text", TEXTS)
def test_decode_of_encode_is_the_original_text(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_a_word_in_the_vocabulary_is_one_token(tok: Tokenizer) -> None:
    for word in ("Hello", "Ġworld", "Ġcapital", "ĠFrance"):
        assert tok.encode(word.replace("Ġ", " ")) == [tok.tokens.index(word)]
    assert tok.encode("What is the capital of France?") == [
        1780, 314, 260, 3575, 282, 4649, 47]


def test_digits_are_split_one_by_one(tok: Tokenizer) -> None:
    assert tok.encode("2024") == [tok.tokens.index(d) for d in "2024"]


def test_special_markers_become_control_tokens_only_when_asked(tok: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.encode(text, special=True) == [1, 4093, 198, 6004, 2, 198]
    plain = tok.encode(text)
    assert 1 not in plain and 2 not in plain
    assert tok.decode(plain) == text


def test_special_ids_come_from_the_gguf(tok: Tokenizer) -> None:
    sp = tok.special
    assert (sp.bos, sp.eos, sp.add_bos) == (1, 2, False)
    assert {2, 0} <= sp.end_of_generation  # <|im_end|> (EOS) and <|endoftext|>
    assert tok.n_vocab == 49152


def _whole_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("text", ["日本語", "😀👍🏽", "🦀 crab", "a😀b"])
def test_streaming_never_emits_a_broken_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert not all(_whole_utf8(tok.token_bytes(t)) for t in ids), "no character is split here"
    decoder = tok.stream()
    parts = [decoder.feed(t) for t in ids] + [decoder.finish()]
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)


def test_streaming_a_cut_off_character_ends_in_a_replacement_mark(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    decoder = tok.stream()
    assert "".join(decoder.feed(t) for t in ids[:-1]) == ""
    assert decoder.finish() == "\ufffd"


def test_streaming_drops_control_tokens_the_model_emits(tok: Tokenizer) -> None:
    decoder = tok.stream()
    assert decoder.feed(1) == "" and decoder.feed(tok.encode("Hi")[0]) == "Hi"


def test_chat_template_from_the_gguf_adds_the_generation_prompt(tok: Tokenizer) -> None:
    text = ChatTemplate.of(tok).render([Message("system", "Be brief."), Message("user", "Hi")])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_chat_template_continues_a_final_assistant_message(tok: Tokenizer) -> None:
    text = ChatTemplate.of(tok).render([Message("user", "Hi"), Message("assistant", "Hello,")])
    assert text.endswith("<|im_start|>assistant\nHello,")


def test_a_template_cannot_reach_python_internals() -> None:
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([Message("user", "x")])


def test_a_template_can_refuse_messages() -> None:
    strict = ChatTemplate("{% if messages[0].role != 'user' %}"
                          "{{ raise_exception('first message must be from the user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        strict.render([Message("assistant", "x"), Message("user", "y")])


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all, not even close")
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf(bad)


def reference_bpe(tok: Tokenizer, text: str) -> list[int]:
    """A from-the-definition byte-level BPE, independent of HF tokenizers: llama.cpp's "smollm"
    split (each digit alone, then GPT-2's regex), bytes -> GPT-2 characters, then merge
    the lowest-ranked adjacent pair until none is in the merge list."""
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|"
                         r"\s+(?!\S)|\s+")
    to_char = {b: c for c, b in _unicode_to_byte().items()}
    ranks = merge_ranks()
    ids = {t: i for i, t in enumerate(tok.tokens)}
    out = []
    for chunk in regex.split(r"(\p{N})", text):
        for word in gpt2.findall(chunk):
            parts = [to_char[b] for b in word.encode()]
            while len(parts) > 1:
                pairs = [(ranks.get((a, b), 1 << 30), i)
                         for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))]
                rank, i = min(pairs)
                if rank == 1 << 30:
                    break
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            out += [ids[p] for p in parts]
    return out


@lru_cache(maxsize=1)
def merge_ranks() -> dict[tuple[str, str], int]:
    """tokenizer.ggml.merges of the bundled GGUF, read with the project's header parser."""
    meta = {k: v for k, _, v in read_header(bundled_path()).metadata}
    pairs = [m.decode().split(" ", 1) for m in meta["tokenizer.ggml.merges"][1]]
    return {(a, b): i for i, (a, b) in enumerate(pairs)}


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_a_from_the_definition_bpe(tok: Tokenizer, text: str) -> None:
    assert tok.encode(text) == reference_bpe(tok, text)


def test_user_defined_tokens_are_text_and_control_tokens_are_left_out_when_decoding() -> None:
    """As llama.cpp renders them: Qwen's <tool_call> (user-defined in its GGUFs) is text the
    model writes, where the tool-call reader finds it; <|im_end|> (control) is not."""
    from kvasird.text.tokenizer import CONTROL, USER_DEFINED, SpecialTokens, Tokenizer

    tokens = ["a", "b", "<tool_call>", "<|im_end|>"]
    tok = Tokenizer(tokens, [1, 1, USER_DEFINED, CONTROL], [], "default",
                    SpecialTokens(None, 3, None, False, frozenset({3})))
    assert tok.decode([0, 2, 1, 3], skip_special=True) == "a<tool_call>b"
    assert tok.decode([0, 2, 1, 3]) == "a<tool_call>b<|im_end|>"
    stream = tok.stream()
    assert "".join(stream.feed(t) for t in (0, 2, 1, 3)) == "a<tool_call>b"
