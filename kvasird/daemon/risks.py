"""Settings that are risky together, said as the daemon starts (a warning, a banner line).

Only combinations that give away what the operator most likely meant to keep: each
sentence says what happens and what to set.
"""

from __future__ import annotations

from kvasird.config import Config
from kvasird.http import is_loopback, is_wildcard


def risky_settings(config: Config, config_path: str) -> list[str]:
    """What is risky in ``config`` (read from ``config_path``), a sentence each."""
    gateway, settlement = config.gateway, config.settlement
    host = gateway.listen.rpartition(":")[0]
    if not (gateway.enabled and settlement.enabled) or is_loopback(host):
        return []
    risks = []
    if settlement.free_local:
        closed = is_wildcard(host) and not gateway.allowed_hosts
        risks.append(
            f"[settlement] free_local = true while [gateway] listen = {gateway.listen!r} "
            "reaches beyond this machine: every client that a proxy or tunnel on this machine "
            "relays without a Forwarded or X-Forwarded-For header is served at your expense "
            "(without a quote; the gateway pays the peers for it from your wallet)"
            + (
                ", and clients that name the gateway by anything but a loopback address get "
                "421 until [gateway] allowed_hosts lists that name"
                if closed
                else ""
            )
            + f"; set free_local = false in {config_path}"
        )
    if not settlement.wallet:
        risks.append(
            f"the gateway on {gateway.listen!r} takes payments but [settlement] wallet names "
            "no keypair file: it can neither refund a request that fails nor pay the peers "
            f"that serve it; set wallet in {config_path} to the keypair file of its address "
            "(`kvasird wallet new` makes one)"
        )
    return risks
