"""The daemon: every service of a node in one trio nursery.

    node      Node: opens state, starts p2p then the admin API, reports status; run_until_signal
    wiring    what the node hands the gateway and the admin API: narrow views, never the node
    systemd   sd_notify (READY, STATUS, STOPPING, WATCHDOG) without extra dependencies
    banner    the startup banner; what the node waits for, then "ready" once it serves
    risks     settings that are risky together, said at start (a warning, a banner line)
    earnings  the admin API's view of the money: earned, owed, claimed
    init      a node's home made (key, checked config, wallet, database): ``kvasird init``

Lifecycle: load config -> open state.db and node key -> P2PNode.running() (listening,
gossip, liveness, exchange, bootstrap) -> admin API -> gateway -> banner -> STATUS= (and
"waiting" lines) until the gateway can serve its model, then READY=1 and "ready" -> wait
for SIGTERM/SIGINT -> STOPPING=1 -> close peers, flush state, remove admin.json -> exit 0.
A second SIGINT exits at once.
"""
