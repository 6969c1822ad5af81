"""Page keys: the names prefix reuse files KV pages under, and the unit sessions grow by.

A page's key names its tokens and everything before them, a chain over the full pages of
a session's tokens:

    tokens ─▶ page_keys: key[i] = H(key[i-1], tokens of page i)

The gateway computes them, which alone sees every token (a stage behind the first sees
hidden rows only), and sends them with the prompt; the stages file and find pages under
them (prefix.py). So this module imports nothing of ggml: the gateway, its router
(inference/client/affinity.py) and the stage protocol use it without loading the engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvasird.compute.errors import InputError

PAGE = 64
"""Slots per page: the unit a session grows by."""

KEY_BYTES = 16
"""Bytes of one page key (blake2b-128): collisions are out of reach for any number of pages."""


def page_keys(tokens: Sequence[int]) -> bytes:
    """The chain keys of the full pages of `tokens`, concatenated: key i (KEY_BYTES) names
    page i's tokens and everything before them, so equal keys mean equal positions 0.. the
    page's end."""
    ids = np.asarray(tokens, dtype="<i4")
    out, key = bytearray(), b""
    for i in range(len(ids) // PAGE):
        key = hashlib.blake2b(
            key + ids[i * PAGE : (i + 1) * PAGE].tobytes(), digest_size=KEY_BYTES
        ).digest()
        out += key
    return bytes(out)


def split_keys(keys: bytes) -> list[bytes]:
    """page_keys' output as a list of keys (a length not a multiple of KEY_BYTES: InputError)."""
    if len(keys) % KEY_BYTES:
        raise InputError(f"page keys come in {KEY_BYTES}-byte units, got {len(keys)} bytes")
    return [keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]
