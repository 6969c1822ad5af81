"""Errors of the compute engine.

    NativeError (kvasird.errors)
    └── ComputeError            the engine cannot do what was asked; nothing reached ggml
        ├── WeightsError        the GGUF lacks a tensor, holds the wrong shape, or an unknown arch
        ├── InputError          a shape, dtype, token id, position or expert id is out of range
        ├── KVCacheFull         the session or the pool has no room for more tokens
        └── RunRefused          one session's step of a batch is refused (the others may go)

Every check runs in Python *before* a graph is computed: an out-of-range id segfaults
ggml and a failed GGML_ASSERT aborts the whole process (STACK.md), so a bad request
from a peer must end here, as an exception, never inside the native code.
"""

from __future__ import annotations

from kvasird.errors import NativeError


class ComputeError(NativeError):
    """The engine refused a request or a model; the message says which value and why."""


class WeightsError(ComputeError):
    """The weights file does not hold what the engine was asked to load."""


class InputError(ComputeError):
    """A request's shape, dtype, token id, position or expert id is invalid."""


class KVCacheFull(ComputeError):
    """No KV cache room left: free sessions, shorten the context or raise the pool size."""


class RunRefused(ComputeError):
    """One run of a batch (Stage.forward_batch) was refused before anything computed: the
    batch may go on without it, and that session's step alone gets `error`."""

    def __init__(self, index: int, error: ComputeError) -> None:
        super().__init__(f"step {index} of the batch: {error}")
        self.index, self.error = index, error
