"""The floating price: utilization moves it inside a band set by governance.

Price is in KVR base units per 1000 tokens: ``price`` is an output token's, and an input
(prompt) token costs ``input_bps`` of it, never less than the floor (a prompt token is one
position of the ring, computed with the others in one pass: cheaper, as every API prices
it). Each observation of utilization (busy
capacity / offered capacity, 0..1) is smoothed (EMA) and the price is multiplied by
exp(gain × (smoothed − target)): idle supply pulls it toward the floor, congestion
toward the ceiling, and it never leaves [floor, ceiling]. The band and the gains are
``NetworkParams``; only ``governance`` changes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvasird.settlement.errors import GovernanceRejected
from kvasird.settlement.token import KVR_DECIMALS

DEFAULT_CREDIT_UNITS = 4_000_000
"""A gateway's credit of unreceipted work at each peer: a 4k-token prompt through 100
layers with room to spare, and a few KVR cents at genesis prices."""
DEFAULT_INPUT_BPS = 2500
"""An input token costs a quarter of an output token."""


@dataclass(frozen=True)
class NetworkParams:
    """Economic parameters of a network, versioned and signed by its genesis wallet."""

    version: int
    """Monotonic version; a message with a version not above the current one is stale."""
    floor: int
    """Lowest price (base units per 1000 tokens); kept above node marginal cost."""
    ceiling: int
    """Highest price; kept below centralized alternatives."""
    target_utilization: float
    """Utilization at which the price holds still."""
    gain: float
    """Log-price change per unit of utilization error per observation."""
    smoothing: float
    """EMA weight of each new utilization observation (0 < smoothing <= 1)."""
    stake_min: int = 0
    """KVR base units a gateway operator's wallet must hold for the network's peers to
    serve its sessions (checked on chain by each peer; held, not locked by a program)."""
    credit_units: int = DEFAULT_CREDIT_UNITS
    """Units of work (positions × layers, expert rows × experts) a serving peer computes
    for a gateway wallet ahead of the receipts that cover them."""
    input_bps: int = DEFAULT_INPUT_BPS
    """An input token's price as a share of an output token's, in basis points."""

    @property
    def free(self) -> bool:
        """A network whose governance set the price to zero: peers serve everyone."""
        return self.ceiling == 0

    def __post_init__(self) -> None:
        problems = [
            text
            for bad, text in (
                (self.version < 0, "version must be >= 0"),
                (not 0 <= self.floor <= self.ceiling, "need 0 <= floor <= ceiling"),
                (
                    self.floor == 0 < self.ceiling,
                    "a floor of 0 is only for a free network (ceiling 0 too)",
                ),
                (self.stake_min < 0, "stake_min must be >= 0"),
                (self.credit_units < 0, "credit_units must be >= 0"),
                (not 0 < self.input_bps <= 10_000, "input_bps must be in (0, 10000]"),
                (not 0 < self.target_utilization < 1, "target_utilization must be in (0, 1)"),
                (not 0 < self.gain <= 5, "gain must be in (0, 5]"),
                (not 0 < self.smoothing <= 1, "smoothing must be in (0, 1]"),
            )
            if bad
        ]
        if problems:
            raise GovernanceRejected(f"invalid network parameters: {'; '.join(problems)}")

    def to_wire(self) -> dict[str, Any]:
        """Canonical form (ints as ints, floats as floats): signatures are over these bytes.
        A parameter added later is left out while it holds its default, so a message signed
        before it existed still verifies."""
        out: dict[str, Any] = {
            "version": int(self.version),
            "floor": int(self.floor),
            "ceiling": int(self.ceiling),
            "target_utilization": float(self.target_utilization),
            "gain": float(self.gain),
            "smoothing": float(self.smoothing),
            "stake_min": int(self.stake_min),
        }
        for name, default in (
            ("credit_units", DEFAULT_CREDIT_UNITS),
            ("input_bps", DEFAULT_INPUT_BPS),
        ):
            if getattr(self, name) != default:
                out[name] = int(getattr(self, name))
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> NetworkParams:
        try:
            return cls(
                int(data["version"]),
                int(data["floor"]),
                int(data["ceiling"]),
                float(data["target_utilization"]),
                float(data["gain"]),
                float(data["smoothing"]),
                int(data.get("stake_min", 0)),
                int(data.get("credit_units", DEFAULT_CREDIT_UNITS)),
                int(data.get("input_bps", DEFAULT_INPUT_BPS)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GovernanceRejected(f"malformed network parameters: {exc}") from None


GENESIS_STAKE_MIN = 100_000 * 10**KVR_DECIMALS
"""100,000 KVR: what a wallet must hold to operate a gateway (the seeds' rule)."""
GENESIS_PARAMS = NetworkParams(
    version=0,
    floor=200,
    ceiling=20_000,
    target_utilization=0.7,
    gain=0.5,
    smoothing=0.3,
    stake_min=GENESIS_STAKE_MIN,
)
"""The parameters every network starts with until its genesis wallet signs others."""


class PriceController:
    def __init__(self, params: NetworkParams = GENESIS_PARAMS, price: float | None = None) -> None:
        self._params = params
        self._utilization = params.target_utilization
        self._price = float(
            price if price is not None else math.sqrt(params.floor * params.ceiling)
        )
        self._clamp()

    @property
    def params(self) -> NetworkParams:
        return self._params

    @property
    def price(self) -> int:
        """Current price of an output token, base units per 1000 tokens."""
        return round(self._price)

    @property
    def input_price(self) -> int:
        """Current price of an input (prompt) token, base units per 1000 tokens."""
        p = self._params
        return min(max(self.price * p.input_bps // 10_000, p.floor), p.ceiling)

    def observe(self, utilization: float) -> int:
        """Feed one utilization sample (clipped to [0, 1]); returns the new price."""
        p = self._params
        sample = min(max(utilization, 0.0), 1.0)
        self._utilization += p.smoothing * (sample - self._utilization)
        self._price *= math.exp(p.gain * (self._utilization - p.target_utilization))
        self._clamp()
        return self.price

    def retune(self, params: NetworkParams) -> None:
        """Adopt new governance parameters, keeping the price inside the new band."""
        self._params = params
        self._clamp()

    def amount_for(self, tokens: int, prompt_tokens: int = 0) -> int:
        """Base units due for ``prompt_tokens`` in and ``tokens`` out at the current prices
        (rounded up once, for the whole request)."""
        return -(-(self.price * tokens + self.input_price * prompt_tokens) // 1000)

    def _clamp(self) -> None:
        self._price = min(max(self._price, self._params.floor), self._params.ceiling)
