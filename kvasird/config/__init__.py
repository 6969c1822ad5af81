"""kvasird.toml: the typed configuration, its defaults, loading and rendering.

    config/kvasird.toml (repo)  --init-->  <home>/kvasird.toml  --load()-->  Config
                                 render()     (operator edits)     validate

The commented default file is the single source of the defaults: ``load`` merges the
operator's file over it, so a key missing from the operator's file takes the default.
"""

from kvasird.config.load import default_text, load, load_text, render
from kvasird.config.model import (
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
