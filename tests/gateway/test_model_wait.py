"""The gateway waits for its model's manifest without dying of a read that fails meanwhile."""

from __future__ import annotations

import trio

from kvasird.config import GatewayConfig
from kvasird.gateway.service import Gateway
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from tests.support import eventually_async


async def test_a_model_read_that_fails_is_retried_not_the_end_of_the_node() -> None:
    calls: list[str] = []

    def source() -> Manifest | None:
        calls.append("asked")
        if len(calls) == 1:
            return None  # not there yet
        if len(calls) == 2:  # a manifest replaced under us while we read it
            raise FileNotFoundError("manifest.tmp")
        return Manifest.from_gguf(bundled_path())

    gateway = Gateway(GatewayConfig(listen="127.0.0.1:0"), model=source)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(gateway.run)
        assert url.startswith("http://127.0.0.1:")
        await eventually_async("the gateway loads its tokenizer", lambda: gateway._tokenizers,
                               timeout=30)
        nursery.cancel_scope.cancel()
    assert len(calls) == 3
