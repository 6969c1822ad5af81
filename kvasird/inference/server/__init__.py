"""The serving side: what this node computes for others.

    engine     Holdings (the units held, as ranges) -> Served: the stages and expert workers
               built from them on one ggml backend; run_short (in place or in a thread)
    stage      StageServer: "/kvasir/stage/1" sessions (KV, admission, idle expiry, limits),
               steps computed and forwarded to the next hop, results to the owner
    experts    ExpertServer: "/kvasir/experts/1" rows of concurrent callers batched per layer
    batch      concurrent sessions' decode steps through a stage as one batch
    ledger     every session's steps as computed: the commitment a close answers (digests of
               each step's input and output) and the rows a reveal shows, kept a while

The market's loader hands the units this node enrolled into to ``Served.build``:

    head unit          ─▶ embed stage (token ids ─▶ hidden) and head stage (hidden ─▶ logits)
    layers [a, b)      ─▶ one window stage per contiguous run (KV pool of its own)
    experts (l, e0:e1) ─▶ loaded into the window stage when l is in a window, else into a
                          worker-only weight set; both are served to other stages as workers

A window stage dispatches the experts of its MoE layers that it does not hold through
the hooks the client side provides (kvasird.inference.client.dispatch). The messages are
drawn in kvasird.inference.protocol, whose types the handlers receive already validated
(``answer``; ``handle`` takes a message in its wire form from a caller in this process);
a server refuses with errors.Refusal and one of its closed set of codes.
"""
