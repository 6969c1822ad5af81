"""The peer-to-peer layer: one libp2p host and the services around it.

    host       build the host (Noise only, yamux, TCP + WebSocket, no auto-dialer)
    hello      the first message on a heartbeat stream: network, protocol, addresses
    messages   the other frames of heartbeat, peer exchange, dial-back and address push
    liveness   heartbeats; the single writer of the peer table; drops dead peers
    peers      the peer table (in memory) and known peers (persisted in state.db)
    dialer     bootstrap peers with backoff, known peers at start, exchanged peers
    exchange   peer exchange: learn peers from peers
    psk        the optional pre-shared key of a private swarm (pnet)
    reachability  dial-back checks (/kvasir/dialback/1): public, private or unknown
    relay      circuit relay v2: relay service, reservations, relayed dials, address push
    dht        Kademlia peer routing: find peers by id and beyond the bootstrap list
    mdns       LAN discovery by multicast DNS
    streams    served(): the bounded, always-closed life of a served stream
    gossip     gossipsub for the control plane (topics kvasir/<network>/...)
    node       P2PNode: all of the above in one nursery

Data flow: connections -> liveness (hello validated) -> peer table -> exchange/DHT/status;
reachability verdict -> relay service on/off, reservations, DHT server/client mode.

Clocks. Heartbeats, silence, dial and circuit backoffs run on trio's clock
(trio.current_time()), which a MockClock drives. The peer table and relay reservations
take `clock: Callable[[], float]` (time.time unless given): their times are unix time,
persisted in state.db or stated by the relay, and a test moves the clock by hand. Stamps
only (a reachability check's time, gossip message ids after a restart) read time.time.
"""

from kvasird.p2p.node import P2PNode

__all__ = ["P2PNode"]
