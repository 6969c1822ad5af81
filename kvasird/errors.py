"""The one error root of kvasird.

    KvasirError                 anything kvasird raises on purpose; str() tells the user what to do
    ├── ConfigError             kvasird.toml is missing, unparsable, or a value is out of range
    ├── HomeError               the state directory is missing, not initialised, or already initialised
    ├── DaemonNotRunning        a CLI command needs the running daemon and found none
    ├── WireError               a peer sent bytes that do not decode or exceed a limit
    ├── PeerError               a peer could not be reached or misbehaved
    └── NativeError             the ggml runtime is missing or cannot do what was asked

Subsystems add their own subclasses next to their code; they always derive from one of these.
"""

from __future__ import annotations


class KvasirError(Exception):
    """Base of every error kvasird raises on purpose."""


class ConfigError(KvasirError):
    """The configuration cannot be used; the message names the file, the key and what is allowed."""


class HomeError(KvasirError):
    """The state directory is not in the state the command needs."""


class DaemonNotRunning(KvasirError):
    """No daemon answers for this home."""


class WireError(KvasirError):
    """Bytes from a peer failed to decode, validate, or fit the limits."""


class PeerError(KvasirError):
    """A peer could not be reached or did not answer in time."""


class NativeError(KvasirError):
    """The native (ggml) runtime is missing or lacks a capability."""


def first_kvasir_error(exc: BaseException) -> KvasirError | None:
    """The first KvasirError inside ``exc`` (trio nurseries wrap errors in groups)."""
    if isinstance(exc, KvasirError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := first_kvasir_error(inner)) is not None:
                return found
    return None
