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
    inference  a prompt's token ids into tokens, on one node or along a route of peers
    text       text into token ids and back: tokenizer, chat templates, grammars, tool calls
    gateway    OpenAI- and Anthropic-compatible HTTP on any node, and its dashboard
    settlement the Solana side: local chain, payments, receipts
    cli        one module per ``kvasird`` subcommand

Layering: a package imports only the packages its line names below, besides errors, logs and
this root module (its version numbers), which every package may import. A line names only
packages drawn under it, so no import goes up and no two packages import each other; the
engine (compute) is reached through inference's API, never by the gateway or the admin API.
tests/unit/test_layering.py reads this drawing and holds every import in kvasird to it.

    __main__   → cli
    cli        → localnet daemon admin inference text settlement model numerics compute
                 identity db home config
    localnet   → daemon settlement market model compute identity home config
    daemon     → admin gateway inference settlement market model compute p2p identity db
                 http home ports config
    admin      → gateway inference settlement p2p http home config
    gateway    → inference text settlement model p2p http config
    inference  → text market settlement model compute p2p wire ports config
    text       → model compute
    numerics   → compute
    compute    → model
    market     → settlement model p2p wire config
    model      → p2p wire db home
    settlement → p2p wire home config
    p2p        → wire identity db ports config
    http       → ports
    wire       →
    identity   →
    db         →
    home       →
    ports      → config
    config     →
    logs       →
    errors     →
"""

from __future__ import annotations

__version__ = "0.1.0"

PROTOCOL_VERSION = 3
"""Wire protocol version carried in every record; peers on another version are not served."""
