"""The typed configuration. Each field's metadata says what values are allowed."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from kvasird.errors import ConfigError

MAX_PORT = 65535


def _range(lo: float, hi: float) -> dict[str, Any]:
    return {"range": (lo, hi)}


def _choice(*values: str) -> dict[str, Any]:
    return {"choices": values}


def _check_port(key: str, host_port: str) -> None:
    """Refuse a host:port whose port is past MAX_PORT (its pattern lets five digits by)."""
    port = host_port.rpartition(":")[2]
    if port.isdigit() and int(port) > MAX_PORT:
        raise ConfigError(
            f"{key} = {host_port!r} has port {port}, which is out of range: "
            f"allowed 0..{MAX_PORT} (0 = any free port)"
        )


_ORIGIN = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)"
    r"(:[0-9]{1,5})?"
)
"""An origin as a browser sends it: scheme, host and port, no path."""


def _check_origin(origin: str, hosts: tuple[str, ...]) -> None:
    """A CORS origin whose host the Host guard lets through (loopback or one of ``hosts``):
    an origin it refuses would look allowed here and fail in the browser."""
    if origin == "*":
        return
    match = _ORIGIN.fullmatch(origin)
    if match is None:
        raise ConfigError(
            f"gateway.cors_origins has {origin!r}, which is not an origin: write "
            'scheme://host[:port] with no path, e.g. "http://localhost:5173", '
            'or "*" for any'
        )
    host = match.group(1).strip("[]").lower()
    if not _is_local(host) and host not in {h.strip("[]").lower() for h in hosts}:
        raise ConfigError(
            f"gateway.cors_origins has {origin!r}, but the gateway refuses pages "
            f"of {host!r}: add {host!r} to gateway.allowed_hosts too"
        )


def _is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_HOST_NAME = {
    "pattern": r"[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*"
    r"|\[?[0-9a-fA-F.]*:[0-9a-fA-F.]*:[0-9a-fA-F:.]*\]?"
}
"""A bare host name or IP address (IPv6 in brackets or not): no scheme, no port."""


@dataclass(frozen=True)
class NodeConfig:
    network: str = field(default="kvasir-local", metadata={"pattern": r"[a-z0-9][a-z0-9._-]{0,63}"})
    """Network name; gossip topics are kvasir/<network>/..."""
    log_level: str = field(default="info", metadata=_choice("debug", "info", "warning", "error"))
    """Minimum level logged."""


@dataclass(frozen=True)
class P2PConfig:
    listen: tuple[str, ...] = field(
        default=("/ip4/0.0.0.0/tcp/4001",), metadata={"multiaddr": True}
    )
    """Multiaddrs to listen on."""
    announce: tuple[str, ...] = field(default=(), metadata={"multiaddr": True})
    """Addresses announced instead of the listen addresses."""
    bootstrap: tuple[str, ...] = field(default=(), metadata={"multiaddr": True, "p2p": True})
    """Peers to join through; each ends in /p2p/<peer id>."""
    heartbeat_interval_s: float = field(default=5.0, metadata=_range(0.2, 60))
    """Seconds between heartbeats to each peer."""
    liveness_timeout_s: float = field(default=15.0, metadata=_range(2, 120))
    """A peer silent this long is dropped."""
    peer_exchange_interval_s: float = field(default=10.0, metadata=_range(0.5, 600))
    """Seconds between peer-exchange rounds."""
    max_peers: int = field(default=64, metadata=_range(1, 4096))
    """Upper bound on connected peers."""
    peer_exchange: bool = True
    """Ask connected peers whom they know (off: rely on bootstrap, DHT and mDNS alone)."""
    psk_file: str = ""
    """Pre-shared key file of a private swarm ("" = the open network of this name)."""
    dht: bool = True
    """Kademlia DHT for peer routing (server mode when public, client mode when private)."""
    mdns: bool = True
    """Find peers of this network on the local network by mDNS."""
    relay_service: str = field(default="auto", metadata=_choice("auto", "on", "off"))
    """Offer circuit relay v2 to private peers: "auto" only while publicly reachable."""
    relay_reservations: int = field(default=2, metadata=_range(0, 8))
    """Relays a private node keeps a reservation on (its /p2p-circuit addresses)."""
    reachability_interval_s: float = field(default=300.0, metadata=_range(1, 86400))
    """Seconds between dial-back checks of our addresses (the first runs once peers answer)."""


@dataclass(frozen=True)
class AdminConfig:
    listen: str = field(default="127.0.0.1:5101", metadata={"loopback": True})
    """host:port of the local admin API; the host must be a loopback address."""
    allowed_hosts: tuple[str, ...] = field(default=(), metadata=_HOST_NAME)
    """Names the admin API answers to besides localhost and loopback addresses (the Host
    header of anything else is refused: a guard against DNS rebinding)."""


@dataclass(frozen=True)
class MarketConfig:
    model: str = field(default="")
    """The model whose units this node offers to hold ("" = hold nothing): a GGUF path,
    bundled:NAME, or a model id peers announce (kvasird.model.ref)."""
    memory_budget_mb: int = field(default=0, metadata=_range(0, 1 << 24))
    """Megabytes of model units this node may hold; 0 = none (gateway/client only)."""
    hold: tuple[str, ...] = field(default=(), metadata={"holdings": True})
    """Pinned units: "head", "layers:A-B", "experts:L:E0-E1"; always held."""
    target_replicas: int = field(default=2, metadata=_range(1, 64))
    """Replicas wanted per unit (the network's parameter; governance may override it)."""
    heartbeat_s: float = field(default=5.0, metadata=_range(0.2, 300))
    """Seconds between coverage records; a record lives 3 heartbeats."""
    rebalance_s: float = field(default=15.0, metadata=_range(0.5, 3600))
    """Seconds between enrollment decisions (jittered)."""
    enroll_delay_s: float = field(default=10.0, metadata=_range(0, 600))
    """Upper bound of the random delay before the first enrollment (no pile-ups)."""


@dataclass(frozen=True)
class ComputeConfig:
    threads: int = field(default=0, metadata=_range(0, 1024))
    """ggml compute threads; 0 = one per physical core."""
    device: str = ""
    """The ggml device to compute on: "" (the CPU), or a device of the installed ggml-python
    build as `kvasird native info` lists them ("CUDA0", "Vulkan0", ...)."""


@dataclass(frozen=True)
class InferenceConfig:
    serve: bool = True
    """Load enrolled units into the engine and serve them; off = hold bytes only (tests of
    the market alone, seed nodes)."""
    wire_dtype: str = field(default="f32", metadata=_choice("f32", "f16"))
    """Hidden states and expert rows on the wire: "f32" (exact) or "f16" (half the bytes)."""
    max_sessions: int = field(default=64, metadata=_range(1, 65536))
    """Sessions this node serves at once; more are refused as busy."""
    kv_slots: int = field(default=8192, metadata=_range(64, 1 << 22))
    """KV cache slots (tokens, all sessions together) of each layer window served."""
    state_slots: int = field(default=8, metadata=_range(1, 4096))
    """Sessions that can hold a recurrent state at once in each layer window with delta-net
    layers (Qwen3.5): a fixed block per session (about 2 MiB per delta-net layer at
    Qwen3.5-35B's width), preallocated; more sessions are refused as busy. Slots no
    session holds keep copies of states at page boundaries for prefix reuse."""
    window_sessions: int = field(default=8, metadata=_range(1, 65536))
    """Sessions past a sliding window (gemma3, gpt-oss) whose window of KV each layer
    window with such layers holds at once: those layers keep window + 512 slots per
    session instead of the whole context, preallocated for this many (never more than
    kv_slots); more are refused as busy."""
    kv_dtype: str = field(default="f16", metadata=_choice("f16", "f32"))
    """KV cache precision: "f16" (half the memory; llama.cpp's default, with which our
    logits equal llama.cpp's bit for bit) or "f32"."""
    prefix_cache: bool = True
    """Keep the KV pages of finished requests in the free part of the KV cache, so a request
    that starts with the same tokens (an agent's system prompt and history, sent again on
    every call) computes only what follows them; as a gateway, send requests to the route
    that holds their prefix. Cached pages make way for new sessions' as needed."""
    session_idle_s: float = field(default=120.0, metadata=_range(1, 86400))
    """A session untouched this long is closed and its KV freed."""
    step_timeout_s: float = field(default=20.0, metadata=_range(0.1, 600))
    """A stage that does not answer one step in this time is replaced (failover)."""
    expert_timeout_s: float = field(default=5.0, metadata=_range(0.05, 600))
    """An expert worker that does not answer in this time is replaced."""
    batch_window_ms: float = field(default=1.0, metadata=_range(0, 1000))
    """A worker waits this long to batch concurrent requests for one layer into one call
    (only while requests arrive concurrently), and a stage this long to send the rows of
    its concurrent sessions for one worker and layer as one message (only while several
    sessions step at once). 0 turns both off."""
    batch_sessions: int = field(default=16, metadata=_range(1, 256))
    """Decode steps of up to this many concurrent sessions through the same layers of a
    stage compute as one graph, reading the weights once for all of them (the outputs
    equal each session's alone to float rounding); 1 = every step alone. A lone session
    never waits for company."""
    batch_min_ms: float = field(default=10.0, metadata=_range(0, 60000))
    """Decode steps batch only where a step computes for at least this long alone: shorter
    ones (a small model, a few layers) gain less from reading the weights once than a ring
    loses when the sessions of one batch move through its hops together."""
    batch_pipelined: bool = True
    """Where the sessions of a ring are away at other hops for longer than a batch computes
    here, a batch takes a share of them (a ring of D hops keeps D batches in flight, every
    hop busy); false: every session stepping here joins one batch, the most reuse of the
    weights (for hops whose compute hardly grows with the rows, such as a GPU's)."""
    spot_check: float = field(default=0.05, metadata=_range(0, 1))
    """Fraction of remote expert calls recomputed (on our own copy of the experts, else a
    second replica) and compared; a worker caught is not paid for the session and is
    avoided (docs/verification.md: the rate, its cost, a cheater's expected loss)."""
    spot_check_stages: float = field(default=0.1, metadata=_range(0, 1))
    """Probability that a ring stage's session is checked: the route's first prompt chunk
    is recomputed by other holders of the stage's layers and compared (docs/verification.md)."""
    spot_tolerance: float = field(default=1e-3, metadata=_range(0, 1e6))
    """Largest relative difference (max |a-b| / max |b|) a spot check accepts."""
    unfit_s: float = field(default=300.0, metadata=_range(1, 86400))
    """How long a peer that failed a spot check receives no work; the cap of a peer failing
    at work, whose sentence starts at 15 s and doubles with each failure in a row."""
    unfit_quorum: int = field(default=2, metadata=_range(1, 64))
    """Distinct peers whose gossiped spot-check verdicts against a peer make us avoid it."""
    max_failovers: int = field(default=4, metadata=_range(0, 64))
    """Route rebuilds one generation may go through before it gives up."""
    hot_experts: int = field(default=0, metadata=_range(0, 1 << 16))
    """Experts a stage may cache and compute itself, chosen from what it selects so that
    whole layers' selections become local (each spares a round trip); 0 = no cache."""
    hot_after: int = field(default=64, metadata=_range(1, 1 << 30))
    """Rows dispatched per MoE layer between two plans of the hot-expert cache (the
    first plan after this many)."""
    expert_choice: str = field(default="auto", metadata=_choice("auto", "fallback", "remote"))
    """Where a window holding all of a MoE layer's experts (a fallback replica) computes
    them while other peers serve them too: "auto" per step, by measured round trip and
    compute time (the workers only where they are faster); "fallback" always here;
    "remote" on the workers whenever a fit one holds them."""
    lanes: bool = True
    """Offer and use lanes: direct TCP connections (keyed over libp2p, ChaCha20-Poly1305)
    for stage and expert traffic, faster per hop than libp2p streams (bench/bench_link.py
    measures both). Peers that
    cannot reach each other directly stay on libp2p."""
    lane_port: int = field(default=0, metadata=_range(0, 65535))
    """TCP port for lanes, on the host of the first TCP listen address (0 = any free
    port; set one and open it in the firewall so that peers behind it can use lanes)."""
    speculate: str = field(default="auto", metadata=_choice("auto", "off", "lookup", "draft"))
    """Speculative decoding as a gateway on a route of peers (inference.client.speculate):
    the gateway guesses the next tokens and the route checks them in one pass, so a token
    costs less than one circuit of the ring. "lookup": guesses from the context (prompt
    lookup: what followed the last few tokens where they occurred before); "draft": from
    ``draft_model``, run here; "auto": the draft model when one is set, else lookup, each
    only where the route's circuit is long enough for it to pay; "off": never."""
    draft_model: str = ""
    """A small GGUF with the served model's vocabulary that drafts for it (``speculate``
    "draft" or "auto"); "" = none. Checked against the served model's vocabulary at load."""
    speculate_exact: bool = True
    """Check guesses with every position computed alone, as a decode step computes it:
    greedy output is then token for token the output without speculation. False: all
    positions as one batch, a cheaper check (9 rows: about half the compute on a CPU),
    whose rows differ from single steps by float rounding (a greedy answer may take the
    other side of a near tie)."""
    draft_k: int = field(default=0, metadata=_range(0, 32))
    """Tokens guessed per step; 0 = chosen per generation from the measured acceptance
    and the route's circuit and compute times."""


@dataclass(frozen=True)
class GatewayConfig:
    enabled: bool = True
    """Serve the OpenAI/Anthropic-compatible HTTP gateway and the status page."""
    listen: str = field(
        default="127.0.0.1:8080",
        metadata={"pattern": r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}"},
    )
    """host:port of the gateway; port 0 picks a free port. Loopback unless you mean to expose it."""
    allowed_hosts: tuple[str, ...] = field(default=(), metadata=_HOST_NAME)
    """Names the gateway answers to (Host header; also the host of a web page's Origin)
    besides localhost, loopback addresses and the host of ``listen``."""
    local: bool = False
    """Generate with the whole [market] model loaded on this node (a one-node network)."""
    kv_tokens: int = field(default=8192, metadata=_range(256, 1 << 22))
    """KV cache slots of the local model, shared by all concurrent requests."""
    max_body_bytes: int = field(default=1 << 20, metadata=_range(1024, 1 << 30))
    """Largest request body accepted (HTTP 413 above)."""
    embeddings_pooling: str = field(default="mean", metadata=_choice("mean", "last", "cls"))
    """How /v1/embeddings pools a text's hidden states into one vector when the model's
    GGUF does not say (llama.cpp's --pooling): "mean" of every position, "last" position
    (what causal models trained for embeddings use), "cls" (the first)."""
    max_prompt_tokens: int = field(default=0, metadata=_range(0, 1 << 22))
    """Longest prompt accepted, after the chat template (HTTP 400 above, naming this key);
    0 = what the model's context holds but for one token of reply (llama-server's limit).
    Set it to keep prompts shorter than the context."""
    max_tokens: int = field(default=1024, metadata=_range(1, 1 << 22))
    """The output limit of a request that sets none (max_tokens, max_completion_tokens,
    max_output_tokens). A request may ask for more or less; whatever it asks is clamped to
    what the model's context leaves after its prompt, never refused, and the clamp is
    reported (usage and the x-kvasir-max-tokens header). A paid request is priced for the
    limit it got."""
    max_concurrent: int = field(default=16, metadata=_range(1, 4096))
    """Generations in flight at once; more get HTTP 429."""
    ping_s: float = field(default=10.0, metadata=_range(0.01, 300))
    """Seconds without output after which a streaming response sends a keep-alive ping."""
    max_n: int = field(default=8, metadata=_range(1, 128))
    """Most choices (`n`) one completion request may ask for; each is a generation of its
    own, so a request of n choices counts, and is priced, as n generations."""
    parse_special: bool = True
    """Read a raw /v1/completions string prompt as llama-server does: a control token's
    text (``<|im_start|>``, ``<|im_end|>``) becomes that one token, so chat markup written
    by hand means what the chat template means. Off: every prompt is plain text (the
    markup is spelled out in ordinary tokens). Chat requests always render through the
    template, whose markers are control tokens either way."""
    cors_origins: tuple[str, ...] = ()
    """Web page origins (``scheme://host[:port]``, or "*" for any) whose scripts may read
    the gateway's answers (CORS); none by default. The host of a page must also pass the
    Host guard: loopback, the host of ``listen``, or one of ``allowed_hosts``."""
    metrics: str = field(default="local", metadata=_choice("local", "any", "off"))
    """Who may read /metrics (Prometheus): "local" this machine's requests only (a scraper
    on the same machine, relayed by no proxy), "any" every client that reaches the
    gateway, "off" nobody."""

    def __post_init__(self) -> None:
        _check_port("gateway.listen", self.listen)
        for origin in self.cors_origins:
            _check_origin(origin, (*self.allowed_hosts, self.listen.rpartition(":")[0]))


@dataclass(frozen=True)
class SettlementSection:
    enabled: bool = False
    """Take KVR payments and pay peers; off = a free node (local use, tests)."""
    rpc_url: str = ""
    """Solana JSON-RPC URL of the network's chain; "" runs an embedded local chain. Waited
    for at start (a chain may start after its nodes), up to a bound."""
    wallet: str = ""
    """Operator keypair file (Solana JSON), relative to the home; "" = receive-only."""
    wallet_address: str = ""
    """Payout address when no keypair file is held."""
    kvr_mint: str = ""
    """KVR mint address; "" = the one the chain at ``rpc_url`` names (a kvasird local chain
    does; a cluster cannot, and the node then stops before it joins, saying what to set)."""
    genesis_wallet: str = ""
    """The network's genesis wallet (signer of governance); "" = the one the chain names,
    like ``kvr_mint``."""
    commitment: str = field(
        default="finalized", metadata=_choice("processed", "confirmed", "finalized")
    )
    """Commitment required before crediting."""
    quote_ttl_s: float = field(default=300.0, metadata=_range(5, 86400))
    """How long a quote can be paid."""
    free_local: bool | None = None
    """Serve the operator's own requests (from this machine, relayed by no proxy) without a
    quote. None, "auto" in the file: only while the gateway listens on loopback; one that
    listens beyond it is usually reached through a proxy or tunnel on this machine too,
    whose clients would look local (Config.free_local_in_effect)."""
    max_unpaid: int = field(default=10_000_000, metadata=_range(0, 10**18))
    """KVR base units of a gateway's receipts this node lets go unpaid before it stops
    serving that gateway (10 KVR)."""
    claim_threshold: int = field(default=1_000_000, metadata=_range(0, 10**18))
    """Claim from a gateway by itself once it owes this much (base units; 0 = only by
    `kvasird wallet claim`)."""


@dataclass(frozen=True)
class Config:
    node: NodeConfig = NodeConfig()
    """[node]"""
    p2p: P2PConfig = P2PConfig()
    """[p2p]"""
    admin: AdminConfig = AdminConfig()
    """[admin]"""
    market: MarketConfig = MarketConfig()
    """[market]"""
    compute: ComputeConfig = ComputeConfig()
    """[compute]"""
    settlement: SettlementSection = SettlementSection()
    """[settlement]"""
    inference: InferenceConfig = InferenceConfig()
    """[inference]"""
    gateway: GatewayConfig = GatewayConfig()
    """[gateway]"""

    def replace(self, **sections: Any) -> Config:
        """A copy with whole sections replaced (used by tests and the launcher)."""
        return dataclasses.replace(self, **sections)

    def free_local_in_effect(self) -> bool:
        """Whether requests from this machine need no quote while others need one: payments
        on, and [settlement] free_local on ("auto": while [gateway] listen is loopback)."""
        if not self.settlement.enabled:
            return False
        if self.settlement.free_local is not None:
            return self.settlement.free_local
        return _is_local(self.gateway.listen.rpartition(":")[0].strip("[]").lower())


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in file order."""
    return dict(typing.get_type_hints(Config))
