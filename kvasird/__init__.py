"""kvasird: the node daemon of Kvasir.

One daemon per device. Subpackages, one per concept, data flowing one way
(wire -> validated records -> state -> decisions):

    errors     the one error root (KvasirError) and the whole tree under it
    logs       structlog everywhere: JSON lines off a terminal, text on one
    config     kvasird.toml: defaults, loading, validation, rendering for ``init``
    home       the state directory: paths, node key, admin address file
    ports      the ports a node listens on, each checked free before anything starts
    identity   the node's Ed25519 key and peer id
    db         the SQLite database every subsystem keeps its durable state in
    wire       msgpack framing and limits shared by every stream protocol
    p2p        libp2p host, liveness, bootstrap, peer exchange, gossip
    http       serving an ASGI app with hypercorn in a trio nursery (admin API, gateway)
    admin      the local (127.0.0.1-only) admin API and its client
    daemon     the node: services in one nursery, lifecycle, banner, sd_notify
    localnet   N real daemons on loopback: the demo and the test harness
    compute    the ggml runtime and engine
    numerics   the equivalence contract between the engine and exact math (float64 oracle)
    model      GGUF manifests, slicing, shard store
    market     coverage records, scarcity and enrollment: who holds which units
    inference  a prompt into tokens, on one node or along a route of peers
    gateway    OpenAI- and Anthropic-compatible HTTP on any node, and its dashboard
    settlement the Solana side: local chain, payments, receipts
    cli        one module per ``kvasird`` subcommand
"""

from __future__ import annotations

__version__ = "0.1.0"

PROTOCOL_VERSION = 2
"""Wire protocol version carried in every record; peers on another version are not served."""
