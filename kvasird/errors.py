"""The one error root of kvasird, and the whole tree under it.

A branch is a kind of failure a caller can handle as a whole; every class kvasird raises
on purpose sits under one (modules are under kvasird.; str() always says what to do):

KvasirError                      errors               anything kvasird raises on purpose
├── ConfigError                  errors               kvasird.toml or a value in it is unusable
├── HomeError                    errors               the home is not in the state a command needs
├── DaemonNotRunning             errors               a command needs the daemon; none answers
├── WireError                    errors               a peer's bytes do not decode or fit a limit
│   └── FrameTooLarge            wire.framing         a frame's length is over what may be read
├── PeerError                    errors               a peer could not be reached or misbehaved
│   ├── HopFailed                wire.rpc             a stage or worker failed: route around it
│   │   ├── Refused              wire.rpc             it answered no: busy, gone or bad request
│   │   ├── Silent               wire.rpc             it did not answer in time: busy or hung
│   │   ├── Unreachable          wire.rpc             no stream to it could be opened (yet)
│   │   └── Lied                 inference.client.failover  it accused peers that did nothing
│   ├── PeerMissing              model.transfer       it lacks pieces it was asked for (a proof)
│   └── _Missing                 model.transfer       a holder lacks pieces (the next one is asked)
├── Refusal                      wire.rpc             this node refuses a peer's request; the peer
│                                                     gets its code (busy, gone, bad...) and why
├── NativeError                  errors               the ggml runtime is missing or lacks a feature
│   └── ComputeError             compute.errors       the engine refuses; nothing reached ggml
│       ├── WeightsError         compute.errors       the GGUF lacks a tensor, a shape, or an arch
│       ├── InputError           compute.errors       a shape, token, position or expert is bad
│       │   └── GrammarError     text.grammar         a grammar or schema cannot be followed
│       ├── KVCacheFull          compute.errors       no KV cache room for more tokens
│       ├── RunRefused           compute.errors       one session's step of a batch is refused
│       └── NoWorkers            inference.errors     no fit peer holds experts a stage needs now
├── ModelError                   errors               a model cannot be named, read or obtained
│   ├── ModelRefError            model.ref            no model by that name, id, path, bundled:NAME
│   ├── BundledModelError        model.bundled        the bundled GGUF cannot be fetched or checked
│   ├── GGUFFormatError          model.gguffile       a file is not a GGUF this reader understands
│   ├── ManifestError            model.manifest       a manifest is malformed or not of its id
│   ├── SliceError               model.slice          a slice spec or file does not fit its model
│   ├── StoreError               model.store          the shard store lacks the model or a piece
│   │   ├── AmbiguousName        model.store          a name or id prefix names two models
│   │   └── CorruptPiece         model.store          stored bytes fail their hash (deleted)
│   ├── TransferError            model.transfer       a download did not finish (it resumes)
│   ├── TokenizerError           text.tokenizer       the GGUF's tokenizer is missing or unknown
│   ├── ChatTemplateError        text.chat            the chat template refuses these messages
│   └── SpeculationError         inference.client.speculate  a draft model of another vocabulary
├── GenerationError              inference.api        a generation did not start or was cut short
│   ├── NoRoute                  inference.api        no live peers cover the model now (503)
│   ├── Busy                     inference.api        the route has no capacity left (429)
│   ├── UnknownModel             inference.api        no model by that id or label (404)
│   ├── NotServed                inference.api        peers refuse to work for this gateway (503)
│   ├── ChatError                cli.chat             `kvasird chat`: the gateway refused or is away
│   └── GenerateError            cli.generate         `kvasird generate`: bad input, or no reply
├── ApiError                     gateway.errors       an HTTP API request fails (500), rendered as
│   │                                                 the calling API's own error JSON
│   ├── BadRequest               gateway.errors       400: a field is missing, mistyped, off range
│   ├── NotFound                 gateway.errors       404: unknown model or path
│   ├── PaymentRequired          gateway.errors       402: settlement is on and no valid payment
│   ├── Forbidden                gateway.errors       403: the caller may not use this
│   ├── BodyTooLarge             gateway.errors       413: the body exceeds [gateway] max_body_bytes
│   ├── UnsupportedMediaType     gateway.errors       415: the body is declared as not JSON
│   ├── TooManyRequests          gateway.errors       429: max_concurrent reached, or no capacity
│   └── Unavailable              gateway.errors       503: no route serves the model (yet)
├── SettlementError              settlement.errors    settlement refuses; no money moved
│   ├── ChainError               settlement.errors    the RPC endpoint failed or timed out
│   │   └── ChainRefused         settlement.errors    it answered with an error: not accepted
│   ├── WalletError              settlement.errors    a keypair is missing, malformed, or only an
│   │                                                 address is held
│   ├── PaymentRejected          settlement.errors    the chain does not prove the payment
│   │   └── SignatureAlreadyUsed settlement.errors    that signature already paid for something
│   ├── QuoteError               settlement.errors    a quote is unknown, expired or settled
│   │   └── QuotesTooFrequent    settlement.errors    one client asks for quotes too fast
│   ├── ClaimError               settlement.errors    nothing to claim, or the payout failed
│   ├── ReceiptRejected          settlement.errors    a receipt is badly signed or goes backwards
│   ├── GovernanceRejected       settlement.errors    not signed by the genesis wallet, or stale
│   ├── AdminAuthError           settlement.errors    wallet sign-in or TOTP failed
│   │   └── TotpAlreadyEnrolled  settlement.errors    TOTP is enrolled; no second secret is issued
│   ├── ConsumerError            settlement.consumer  a paid request was refused, or cannot be paid
│   └── NotAdmitted              settlement.admission this node does not work for that gateway
└── LocalNetError                localnet.launcher    `kvasird localnet`: a daemon or the chain did
                                                      not start, stop or answer in time

Subsystems add their classes next to their code, always under one of these branches. The
branches that one subsystem owns are defined in its module (GenerationError, ApiError,
SettlementError, LocalNetError); the shared ones here. tests/unit/test_error_tree.py checks
this drawing against the code: every class, its parent and its module.

Plain Exceptions that never leave their module are no part of the tree: market.gate.Stale
(an old gossip record, ignored), model.transfer._BadBytes (a holder's bytes failed their
hash: the next holder is asked), settlement.localchain.chain.RpcFailure (the local chain's
JSON-RPC error answer).
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


class ModelError(KvasirError):
    """A model cannot be named, read, stored or obtained; the message says which file or id
    and what to do."""


def first_kvasir_error(exc: BaseException) -> KvasirError | None:
    """The first KvasirError inside ``exc`` (trio nurseries wrap errors in groups)."""
    if isinstance(exc, KvasirError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := first_kvasir_error(inner)) is not None:
                return found
    return None
