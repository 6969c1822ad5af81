"""Inference: turning a prompt into tokens, on one node or across the swarm.

    api        the contract between the gateway and whoever generates: GenerationRequest in,
               a stream of TokenEvents out, ending in one Finished (the gateway renders it as
               OpenAI or Anthropic; the generator may be local or a route across peers)
    tokenizer  the model's byte-level BPE from the GGUF (HF tokenizers), streaming-safe decoding
    chat       the GGUF's chat template, rendered in Jinja's sandbox
    local      LocalGenerator: the whole model on this node, ggml in a worker thread, fair turns
    tensors    arrays on the wire: raw f32/f16/i32 bytes in msgpack bin fields, validated
    channel    request/response with ids (and one-way frames) over one long-lived stream
               per peer and protocol, timeouts
    lane       a direct TCP connection keyed over libp2p that carries a channel's hot path
    serving    what this node serves: stages and expert workers built from held units;
               "/kvasir/stage/1" sessions (KV, admission, idle expiry), "/kvasir/experts/1"
               rows batched per layer across callers
    routing    routes from the coverage map (shortest path over layer boundaries by measured
               latency), expert coverage by replicas, unfit peers, our latency measurements
    experts    remote expert dispatch from a stage: replicas, failover, spot checks, the
               hot-expert cache, concurrent sessions' rows for one worker as one message
    verdicts   spot-check verdicts on gossip; a quorum of accusers makes a node avoid a worker
    swarm      SwarmGenerator: plan, open sessions, send steps down the route (each hop
               forwards to the next), probe a silent route, fail over and replay the history
               on a new route
    steptrace  where a traced step's time went: per hop queue / compute / after, the wire
    service    the daemon's wiring: market loader, protocol handlers, admin generate API,
               load reports on gossip

Data flow of one swarm token (boundaries go stage to stage; a hop on this node is a direct
call):

    SwarmGenerator ─ids, route─▶ hop 1 [embed, layers a..b) ─hidden─▶ hop 2 … ─▶
        last hop [layers ..L, head]: logits ─▶ sample ─token─▶ gateway's Inbox ─▶ TokenEvent
    inside a hop, a MoE layer whose experts live elsewhere: router (here) ─rows, local ids─▶
        workers ("/kvasir/experts/1") ─outputs─▶ combine with the router weights (here)
"""
