"""Inference: turning a prompt's token ids into tokens, on one node or across the swarm.

It speaks token ids only: text (tokenizer, chat templates, grammars, tool calls) is
kvasird.text's, at the edges, and HTTP is the gateway's and the admin API's.

The package is split the way a token's data flows: the generating side (client/) plans a
route and sends steps; the serving side (server/) computes them; transport/ carries the
frames; protocol/ says what the frames may hold, and every message is validated there
before a handler sees it.

    api          the contract between the gateway and whoever generates: GenerationRequest in,
                 a stream of TokenEvents out, ending in one Finished (the gateway renders it
                 as OpenAI or Anthropic; the generator may be local or a route across peers)
    errors       the data plane's errors: a hop that failed, refused, or was unreachable
    local        LocalGenerator: the whole model on this node, ggml in a worker thread
    client/      routing, SwarmGenerator (sessions along a route), failover, expert dispatch
                 from a stage, the hot-expert cache
    server/      the engine this node serves (stages, expert workers), the stage server, the
                 expert server
    transport/   channels (request/response and one-way frames over one stream per peer and
                 protocol) and lanes (direct TCP for the hot path)
    protocol/    protocol ids, the messages and their wire form, arrays on the wire
    stepcontext  whose session a step computes for, shared by the stage server and the
                 expert dispatcher it calls through the engine
    steptrace    where a traced step's time went: per hop queue / compute / after, the wire
    verdicts     spot-check verdicts on gossip; a quorum of accusers makes a node avoid a worker
    service      the daemon's wiring: market loader, protocol handlers, load reports on
                 gossip

Data flow of one swarm token (boundaries go stage to stage; a hop on this node is a direct
call):

    SwarmGenerator ─ids, route─▶ hop 1 [embed, layers a..b) ─hidden─▶ hop 2 … ─▶
        last hop [layers ..L, head]: logits ─▶ sample ─token─▶ gateway's Inbox ─▶ TokenEvent
    inside a hop, a MoE layer whose experts live elsewhere: router (here) ─rows, local ids─▶
        workers ("/kvasir/experts/1") ─outputs─▶ combine with the router weights (here)

Clocks. What decides by time takes it from a clock a test can drive: the classes whose
windows are not trio timeouts take `clock: Callable[[], float]` (time.monotonic unless
given: the hot-expert cache's retry wait, the expert server's and the dispatcher's
admission windows, the stage server's idle expiry, kept ledgers and which sessions count
as stepping for batching, the unfit verdicts' window); deadlines and sentences inside
trio (routing's unfit sentences, failover, a step's timeout, lanes, channels) read
trio.current_time(), which a MockClock drives. Measurements only read time.monotonic or
time.perf_counter directly: how long a step computes or queues, latencies, trace stamps,
load reports' windows. Records on gossip and evidence files carry unix time (time.time).
"""
