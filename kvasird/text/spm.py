"""SentencePiece vocabularies as llama.cpp reads them (``tokenizer.ggml.model = "llama"``):
gemma, Llama 2, Mistral and their kin.

A GGUF of this kind carries token strings with scores and no merge list: spaces are
written as U+2581 ("▁"), bytes that no token covers as byte tokens ``<0xXX>``. Encoding
is llama.cpp's, so that our token ids equal its ids for the same text:

1. special tokens are cut out of the text first (user-defined ones always, control
   ones only when the caller parses special tokens), longest first;
2. each run of text between them is prefixed with a space when the vocabulary asks
   (``tokenizer.ggml.add_space_prefix``) and nothing but a special token came before,
   then its spaces become "▁";
3. starting from single characters, the adjacent pair whose concatenation is the token
   with the highest score is merged, again and again (ties: the leftmost);
4. a character no token covers becomes its bytes' tokens (every merged piece is a token).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

SPACE = "\u2581"
"""How SentencePiece writes a space inside a token."""
BYTE = 6
"""llama.cpp's token type of a byte token ``<0xXX>``."""


class SentencePiece:
    """Text <-> ids for one SentencePiece vocabulary."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int],
        specials: Sequence[int],
        user_defined: Sequence[int],
        add_space_prefix: bool,
    ) -> None:
        self.tokens = list(tokens)
        self.scores = list(scores)
        self.add_space_prefix = add_space_prefix
        self._ids: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self._ids.setdefault(t, i)
        unknown = self._ids.get("<unk>", 0)
        self._bytes = [
            self._ids.get(f"<0x{b:02X}>", self._ids.get(chr(b), unknown) if b < 0x80 else unknown)
            for b in range(256)
        ]
        by_length = sorted(specials, key=lambda i: -len(self.tokens[i]))
        self._all_special = [(self.tokens[i], i) for i in by_length if self.tokens[i]]
        user = set(user_defined)
        self._user = [(t, i) for t, i in self._all_special if i in user]
        self.token_bytes = [
            _piece_bytes(t, kind) for t, kind in zip(self.tokens, types, strict=True)
        ]

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        out: list[int] = []
        if not text:
            return out  # not even the space prefix
        after_special = True  # the start counts as "after a special token"
        for part in _partition(text, self._all_special if special else self._user):
            if isinstance(part, int):
                out.append(part)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                part = " " + part
            out += self._merge(part.replace(" ", SPACE))
            after_special = False
        return out

    def _merge(self, text: str) -> list[int]:
        if not text:
            return []
        # symbols as [start, length] over text, linked left to right
        start = list(range(len(text)))
        size = [1] * len(text)
        prev = list(range(-1, len(text) - 1))
        nxt = [*range(1, len(text)), -1]
        queue: list[tuple[float, int, int, int]] = []

        def pair(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            piece = text[start[left] : start[left] + size[left] + size[right]]
            token = self._ids.get(piece)
            if token is None:
                return
            heapq.heappush(queue, (-self.scores[token], left, right, len(piece)))

        for i in range(1, len(text)):
            pair(i - 1, i)
        while queue:
            _, left, right, n = heapq.heappop(queue)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != n:
                continue  # one side was merged into something else since
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            pair(prev[left], left)
            pair(left, nxt[left])
        out: list[int] = []
        i = 0
        while i >= 0:  # every merged piece is a token; a lone character may not be
            piece = text[start[i] : start[i] + size[i]]
            token = self._ids.get(piece)
            if token is not None:
                out.append(token)
            else:
                out.extend(self._bytes[b] for b in piece.encode())
            i = nxt[i]
        return out


def _partition(text: str, specials: Sequence[tuple[str, int]]) -> list[str | int]:
    """``text`` cut at every occurrence of the special token texts, longest first (as
    llama.cpp does: each special token in turn splits what text is left)."""
    parts: list[str | int] = [text]
    for marker, token in specials:
        cut: list[str | int] = []
        for part in parts:
            if isinstance(part, int) or marker not in part:
                cut.append(part)
                continue
            pieces = part.split(marker)
            for k, piece in enumerate(pieces):
                if piece:
                    cut.append(piece)
                if k < len(pieces) - 1:
                    cut.append(token)
        parts = cut
    return parts


def _piece_bytes(token: str, kind: int) -> bytes:
    if kind == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace(SPACE, " ").encode()
