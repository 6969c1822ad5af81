"""The generating side: turning a request into steps along a route of peers.

    routing    routes from the coverage map (shortest path over layer boundaries by measured
               latency), expert coverage by replicas, unfit peers, our latency measurements
    affinity   prefix affinity: which route holds a prompt's start (its hops' kept KV), and
               when taking it beats the cheapest route; the keys each hop files pages under
    swarm      SwarmGenerator: plan, open sessions, send steps down the route (each hop
               forwards to the next), probe a silent route, count each hop's work
    failover   replace the failed hop, close the old route, replay the history on a new one
    dispatch   ExpertDispatcher: a stage's remote experts on their workers (replicas,
               failover, spot checks, concurrent sessions' rows as one message)
    hotcache   HotExperts: experts a stage computes itself to spare round trips
    choice     ExpertChoice: per MoE layer and step, a fallback replica's own copy or the
               workers, by measured round trip and compute time
    speculate  speculative decoding: guesses (prompt lookup, a draft model) checked by the
               route in one pass, how many to guess from what was measured
spotcheck  SpotChecks: a peer's output recomputed elsewhere and compared, the evidence kept
"""
