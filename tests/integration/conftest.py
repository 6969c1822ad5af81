from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvasird.localnet import LocalNet


@pytest.fixture
def localnet(tmp_path: Path) -> Iterator[Callable[..., LocalNet]]:
    """Make LocalNets under tmp_path; every process they started is stopped afterwards."""
    made: list[LocalNet] = []

    def make(n: int, **kwargs: object) -> LocalNet:
        net = LocalNet(tmp_path / f"net{len(made)}", n, **kwargs)  # type: ignore[arg-type]
        made.append(net)
        return net

    yield make
    for net in made:
        net.down()


# Test helpers (gossip_peer.py) are imported by name from this directory.
sys.path.insert(0, str(Path(__file__).parent))
