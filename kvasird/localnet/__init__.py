"""A local network: N real ``kvasird run`` processes on 127.0.0.1, each with its own home.

The demo (``kvasird localnet up``) and the integration tests use this same launcher, so
what the tests prove is what a newcomer runs. Node i bootstraps from node i-1 only
(a chain); peer exchange has to do the rest.

    launcher   LocalNet / LocalNode: init homes, start, wait for readiness, stop, clean up
    placement  settings that pin a node's placement, for tests and benchmarks that count work
    demo       `localnet up`'s model, chain and paid prompt
"""

from kvasird.localnet.launcher import LocalNet, LocalNode

__all__ = ["LocalNet", "LocalNode"]
