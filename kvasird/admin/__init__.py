"""The local admin API: JSON over HTTP on a loopback address only.

    server   the ASGI app and its routes (status, peers); served by hypercorn in trio mode
    generate the inference routes: POST /v0/generate (token ids in, tokens out) and
             GET /v0/inference, served from the node's InferenceService
    client   what the CLI uses to reach a running daemon (address from <home>/admin.json)

The API never carries secrets and is never bound beyond loopback (config validation
refuses anything else), like kubo's RPC API.
"""
