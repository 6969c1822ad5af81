"""Every tokenizer kind the served models' GGUFs declare, against llama.cpp on the same
vocabulary file: byte-level BPE under each pre-tokenizer (qwen2, qwen35, gpt-4o, llama-bpe,
smollm) and gemma's SentencePiece (with and without the space prefix), on texts that
exercise what the pre-tokenizers split differently: case changes, contractions, digits,
combining marks, CJK, emoji, whitespace runs, newlines and special-token markers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvasird.text.tokenizer import Tokenizer, TokenizerError
from kvasird_dev.testvocab import BPE_PRES, SPM_SPECIALS, write_vocab

LLAMACPP_PYTHON = Path(__file__).resolve().parents[2] / ".cache/llamacpp-venv/bin/python"
VOCABS = [("gpt2", pre, False) for pre in BPE_PRES] + [("llama", "", True), ("llama", "", False)]

TEXTS = [
    "Hello world", " leading space", "trailing space ", "double  space and   three",
    "The QUICK brown Fox's tail; they're HERE, we'll see. I'd've",
    "CamelCaseWords and snake_case_words, HTTPServerError", "ALLCAPS lowercase MiXeD",
    "1234567 12 3.14159 1,000,000 2026-12-02 0x1F",
    "café naïve résumé Ångström", "e\u0301 a\u0308 combining n\u0303o", "ǅ ǈ titlecase",
    "日本語のテキストと中文文本", "한국어 텍스트", "Привет, мир! Ελληνικά", "مرحبا بالعالم",
    "emoji 🙂🚀 and 👩‍💻 joined", "tabs\tand\nnew\n\nlines\r\n", "\n\n\nstarts with newlines",
    "def f(x):\n    return x ** 2  # square\n", "<html><body class=\"a\">x</body></html>",
    "a/b/c path/to/file.txt", "!!! ??? ... --- ***", "",
    "<start_of_turn>user\nhi<end_of_turn>\n", "<|im_start|>user\nhi<|im_end|>",
    "a<bos>b", "   ", " ",
]

LLAMACPP = """
import json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.loads(sys.stdin.read())
print(json.dumps([[llm.tokenize(t.encode(), add_bos=False, special=s) for t in texts]
                  for s in (False, True)]))
"""


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, bool], Path]:
    where = tmp_path_factory.mktemp("vocabs")
    return {v: write_vocab(where / f"{v[0]}-{v[1]}-{v[2]}.gguf", *v) for v in VOCABS}


@pytest.mark.llamacpp
@pytest.mark.skipif(not LLAMACPP_PYTHON.exists(), reason="run native/llamacpp to build llama.cpp")
@pytest.mark.parametrize("vocab", VOCABS, ids=[f"{k}-{p or 'spm'}-{s}" for k, p, s in VOCABS])
def test_tokenization_equals_llamacpp(vocabs: dict, vocab: tuple[str, str, bool]) -> None:
    path = vocabs[vocab]
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", LLAMACPP, str(path)], input=json.dumps(TEXTS),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    plain, special = json.loads(done.stdout)
    tok = Tokenizer.from_gguf(path)
    for text, want, want_special in zip(TEXTS, plain, special, strict=True):
        assert tok.encode(text) == want, text
        assert tok.encode(text, special=True) == want_special, text


def test_sentencepiece_round_trips_and_cuts_out_its_markers(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(write_vocab(tmp_path / "spm.gguf", "llama", add_space_prefix=True))
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == (" " + text if text else ""), text
    start, end = (SPM_SPECIALS.index(m) for m in ("<start_of_turn>", "<end_of_turn>"))
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>", special=True)
    # after a special token the text is prefixed with a space, as at the start
    assert ids[0] == start and ids[-1] == end and tok.decode(ids[1:-1]) == " user\nhi"
    assert start not in tok.encode("<start_of_turn>user")  # plain text unless asked
    # a character no piece covers becomes its bytes' tokens
    rare = tok.encode("\U0001D11E", special=False)
    assert len(rare) == 1 + 4 and tok.decode(rare) == " \U0001D11E"


def test_an_unknown_pre_tokenizer_names_those_supported(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="qwen35"):
        Tokenizer.from_gguf(write_vocab(tmp_path / "x.gguf", "gpt2", "no-such-pre"))
