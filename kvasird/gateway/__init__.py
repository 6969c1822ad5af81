"""The gateway: OpenAI- and Anthropic-compatible HTTP on any peer, and the node's status page.

    service     Gateway (the HTTP service in the daemon's nursery) and Job (a checked request)
    app         the Starlette routes, CORS for the allowed origins; errors in each API's shape
    body        reading a body within the size limit; typed fields, errors naming the field
    openai      /v1/chat/completions, /v1/completions, /v1/models[/{id}]: parsing, rendering
    anthropic   /v1/messages, /v1/messages/count_tokens: parsing and rendering
    embeddings  /v1/embeddings: the route's final-norm hidden states, pooled and normalized
    responses   OpenAI's Responses API: POST /v1/responses, GET /v1/responses/{id}
    tools       tools in the two APIs: what a request offers and forces, the calls in a reply
    payment     pay per inference: quote, payment on chain, receipts; the operator's own use
    x402        pay per HTTP call with x402 (402 with PAYMENT-REQUIRED, PAYMENT-SIGNATURE in,
                PAYMENT-RESPONSE out): a quote paid by a transaction the gateway co-signs
    ops         llama-server's /tokenize, /detokenize, /apply-template and /props
    metrics     /metrics: Prometheus text of requests, tokens, latencies, peers, earnings
    generation  a Generator's token events -> text pieces (whole characters, stop sequences);
                the generations of a request's n choices
    stops       text-level stop sequences with held-back partial matches
    response    the ASGI response that runs a generation: SSE or JSON, pings, disconnects
    stats       admission (concurrency limit) and what was served: requests, tokens, speeds
    status      /health (ok | starting | no_model | no_route, with the reason) and /status
                (the JSON snapshot the page polls)
    dashboard   the node's HTML page: topology and route, peers, live tokens/s and latency,
                earnings and claims, the price band, shard downloads, a web chat
    errors      ApiError and its statuses (400, 402, 403, 404, 413, 415, 429, 503)

Data flow of one request:

    HTTP body ─▶ body.read_json (413/415/400) ─▶ openai|anthropic parse ─▶ Gateway.resolve (404/503)
      ─▶ chat template + tokenizer ─▶ limits (400) ─▶ Job
      ─▶ GenerationResponse: admit (429) ─▶ Generator.generate (once a choice) ─▶ pieces
      ─▶ renderer ─▶ SSE events or one JSON body          (client gone ─▶ cancel ─▶ KV freed)

The gateway only ever talks to a Generator through kvasird.inference.api, so a node
holding the whole model (inference.local) and a route across the swarm plug in alike.
"""

from kvasird.gateway.service import Gateway, Job

__all__ = ["Gateway", "Job"]
