"""Settlement settings: what an operator may choose ([settlement] of kvasird.toml, declared
with the file's other sections in kvasird.config.schema) and what only tests tune.

Network economics (the price band and the controller gains) are deliberately absent:
they are network parameters, changed only by a governance message signed by the
genesis wallet (see ``governance``), never by a config file or environment variable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvasird.config.schema import SettlementSection


@dataclass(frozen=True)
class TierThresholds:
    """Per-token latency the gateway itself measured (ms) at or under which a peer earns a tier."""

    s_ms: float = 25.0
    """At or under: tier S (x1.5)."""
    a_ms: float = 60.0
    """At or under: tier A (x1.25)."""
    b_ms: float = 150.0
    """At or under: tier B (x1.0); slower is tier C (x0.7)."""


@dataclass(frozen=True)
class RevenueSplit:
    """How each paid inference is divided, in basis points (sum 10000)."""

    workers_bps: int = 8000
    """Share paid to the peers that did the work, by measured units x tier."""
    operator_bps: int = 1500
    """The gateway operator's fee (also receives rounding remainders)."""
    insurance_bps: int = 500
    """The insurance pool that refunds failed inferences."""

    def __post_init__(self) -> None:
        if self.workers_bps + self.operator_bps + self.insurance_bps != 10_000:
            raise ValueError("revenue split must sum to 10000 basis points")


@dataclass(frozen=True)
class SettlementConfig:
    """What the daemon passes to the settlement subsystem: the operator's [settlement] as
    kvasird.toml has it (one type, declared with the rest of the file's sections), and the
    settings the file does not offer (tests and tooling set them)."""

    section: SettlementSection = SettlementSection()
    """[settlement] of kvasird.toml: RPC URL, wallet (relative to the home), KVR mint,
    genesis wallet, commitment, quote TTL, max unpaid, claim threshold."""
    local_chain_data: Path | None = None
    """Data directory of the embedded local chain (default <home>/localchain)."""
    local_chain_listen: str = "127.0.0.1:0"
    """host:port of the embedded local chain's RPC; port 0 picks a free one."""
    confirm_timeout_s: float = 60.0
    """How long to wait for a payout to reach the commitment before reconciling later."""
    poll_interval_s: float = 0.05
    """Interval between signature-status polls."""
    stake_cache_s: float = 30.0
    """How long a gateway's stake, read from the chain, is trusted."""
    tiers: TierThresholds = TierThresholds()
    """Thresholds of the measured performance tiers."""
    split: RevenueSplit = RevenueSplit()
    """Division of each payment between workers, operator and insurance."""
