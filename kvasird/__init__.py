"""kvasird: the node daemon of Kvasir.

One daemon per device. Subpackages, one per concept, data flowing one way
(wire -> validated records -> state -> decisions):

    config     kvasird.toml: defaults, loading, validation, rendering for ``init``
    home       the state directory: paths, node key, admin address file
    identity   the node's Ed25519 key and peer id
    db         the SQLite database every subsystem keeps its durable state in
    wire       msgpack framing and limits shared by every stream protocol
    p2p        libp2p host, liveness, bootstrap, peer exchange, gossip
    admin      the local (127.0.0.1-only) admin API and its client
    daemon     the node: services in one nursery, lifecycle, banner, sd_notify
    localnet   N real daemons on loopback: the demo and the test harness
    compute    the ggml runtime and engine
    model      GGUF manifests, slicing, shard store
    settlement the Solana side: local chain, payments, receipts
    cli        one module per ``kvasird`` subcommand
"""

from __future__ import annotations

__version__ = "0.1.0"

PROTOCOL_VERSION = 2
"""Wire protocol version carried in every record; peers on another version are not served."""
