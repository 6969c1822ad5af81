"""kvasird.toml: the typed configuration, its defaults, loading and rendering.

    config/kvasird.toml (repo)  --init-->  <home>/kvasird.toml  --load()-->  Config
                                 render()     (operator edits)     validate

    schema   the typed sections and what each value may be (field metadata)
    load     merge over the defaults, validate, render the commented file
    pins     [market] hold's pins as written (head, layers:A-B, experts:L:A-B)

The commented default file is the single source of the defaults: ``load`` merges the
operator's file over it, so a key missing from the operator's file takes the default.
"""

from kvasird.config.load import default_text, load, load_text, render
from kvasird.config.schema import (
    AdminConfig,
    ComputeConfig,
    Config,
    GatewayConfig,
    InferenceConfig,
    MarketConfig,
    NodeConfig,
    P2PConfig,
)

__all__ = [
    "AdminConfig",
    "ComputeConfig",
    "Config",
    "GatewayConfig",
    "InferenceConfig",
    "MarketConfig",
    "NodeConfig",
    "P2PConfig",
    "default_text",
    "load",
    "load_text",
    "render",
]
