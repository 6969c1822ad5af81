"""Delta-net state slots: the recurrent layers' share of a stage's KV pool.

A gated delta-net layer (the Qwen3.5 hybrids) keeps no KV: its session state is a fixed
size, the convolution's last inputs and the delta rule's matrices, and it lives in the
pool too, one row per state slot of `cache_conv.N` and `cache_delta.N`. A session takes a
slot when it first runs and gives it back when it closes, so the same limits and expiry
cover it. Such a state only moves forward: a session can continue where it is or start
again at position 0 (a replay rebuilds it), never rewind in between.

A session also copies its state into a second slot, its mark, at page boundaries, so a
closing session can hand the prefix cache a state to start from (prefix.py). Which slot a
session takes, and which holder gives one up when none is free, the pool decides (pool.py);
this module holds the slots themselves.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvasird.compute.graph import F32, Tensor, TensorArena, ggml
from kvasird.compute.hparams import HParams

if TYPE_CHECKING:
    from kvasird.compute.kv.pool import Session


class StateSlots:
    """The delta-net layers' states, `n_slots` rows each, and which rows are free."""

    def __init__(
        self, arena: TensorArena, hp: HParams, layers: Iterable[int], n_slots: int
    ) -> None:
        """Adds the states of the delta-net layers among `layers` to `arena`."""
        self.conv: dict[int, Tensor] = {}
        """Delta-net layers' convolution states, [conv_state, n_slots] float32."""
        self.delta: dict[int, Tensor] = {}
        """Delta-net layers' recurrent matrices, [delta_state, n_slots] float32."""
        for layer in layers:
            if hp.is_recurrent(layer):
                self.conv[layer] = arena.new(f"cache_conv.{layer}", F32, (hp.conv_state, n_slots))
                self.delta[layer] = arena.new(
                    f"cache_delta.{layer}", F32, (hp.delta_state, n_slots)
                )
        self.free = list(range(n_slots - 1, -1, -1)) if self.conv else []
        """Slots nobody holds, the next one to take last."""
        self.marked: dict[int, Session] = {}
        """Slots holding a live session's mark, and that session."""
        self.rewinds: dict[int, Session] = {}
        """Slots holding a state a live session may go back to (Session.keep_rewind), and
        that session."""

    def copy(self, src: int, dst: int) -> None:
        """Copy slot `src`'s convolution and delta-rule states into slot `dst`."""
        for t in (*self.conv.values(), *self.delta.values()):
            row = int(t.contents.nb[1])
            buf = (ctypes.c_uint8 * row)()
            ggml.ggml_backend_tensor_get(t, buf, src * row, row)
            ggml.ggml_backend_tensor_set(t, buf, dst * row, row)

    def clear(self, slot: int) -> None:
        """Zero a slot's states: a delta-net starts from nothing at position 0."""
        for t in (*self.conv.values(), *self.delta.values()):
            row = int(t.contents.nb[1])
            ggml.ggml_backend_tensor_memset(t, 0, slot * row, row)
