"""The coverage market: no scheduler, every node computes the same map and enrolls itself.

    model      MarketModel: a model as the market sees it (layers, experts, bytes per unit)
    records    CoverageRecord / LoadReport: the gossip records, strict wire validation
    gate       RecordGate: per-peer sequence, clock skew and rate checks; misbehaviour counts
    coverage   CoverageMap: live holders and replica counts per unit, TTL expiry (pure)
    demand     targets from observed load, scarcity per unit, scarce segments (pure)
    enroll     decide(): which units a node should hold within its budget (pure)
    pacing     the herd guard: whether a node takes part in a round, and how much it takes
    publish    when a record goes out (on change, keep-alive), TTLs, suspicion of the dead
    pinning    operator pins ([market] hold = ["head", "layers:0-10", ...])
    proofs     proofs of holding: a claim is believed once the peer answered a challenge
    service    MarketService: gossip in and out, the enrollment loop, unit state machine

Data flow (one way):

    gossip bytes ─► records.from_wire ─► gate ─► CoverageMap ─► demand.scarcity ─► enroll.decide
                                                   ▲                                   │
                          LoadReports ─► Demand ───┘             own CoverageRecord ◄──┘
                                                                  (joining → loading → online)

Everything from `coverage` to `enroll` is pure (no I/O, no clock reads: time is passed in),
so the daemon and the simulator (kvasird_dev.marketsim, beside the package) run the
very same decisions.
"""
