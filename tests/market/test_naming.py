"""One name for a model across the network: holders announce the name in their signed
records, and a node that got the model from peers lists it as the network does."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvasird.config import MarketConfig
from kvasird.market.model import MarketModel
from kvasird.market.records import Capabilities, CoverageRecord, compress
from kvasird.market.service import MarketService
from kvasird.model.manifest import HEAD, Manifest
from kvasird.model.store import ShardStore
from kvasird_dev.testmodels import make_model

from .test_service import p2p

NAME = "smollm2:135m-instruct"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    path = make_model(tmp_path_factory.mktemp("model") / "m.gguf", arch="qwen3", n_layer=2,
                      dtype="q8_0")
    return Manifest.from_gguf(path)


@pytest.fixture
def store(tmp_path: Path):
    with ShardStore(tmp_path / "shards", tmp_path / "state.db") as store:
        yield store


def market(store: ShardStore, manifest: Manifest, me: str = "me") -> MarketService:
    shards = SimpleNamespace(store=store, has_all=lambda model_id: False,
                             open_stream=None)
    service = MarketService(p2p(me), MarketConfig(memory_budget_mb=1),  # type: ignore[arg-type]
                            MarketModel.from_manifest(manifest), Capabilities(), seed=0,
                            shards=shards)  # type: ignore[arg-type]
    service.held = {HEAD: "online"}
    return service


def hear(service: MarketService, peer: str, seq: int, name: str, adopted: bool,
         state: str = "online") -> None:
    """A peer's record, as the gossip validator applies it."""
    assert service.model is not None
    held = {HEAD: "online"} if state != "offline" else {}
    record = CoverageRecord(peer, seq, time.time(), 60, state, 1, "", (),
                            service.model.model_id if held else "", 1 << 30,
                            compress(held), name=name if held else "", adopted=adopted)
    service._apply_coverage(record.to_wire(), peer, time.time(),
                            SimpleNamespace(SerializeToString=lambda: b""))  # type: ignore[arg-type]


def heartbeat(service: MarketService) -> None:
    service._agree_on_name()


def test_a_node_that_got_the_model_by_id_adopts_the_name_its_peers_announce(
        store: ShardStore, manifest: Manifest) -> None:
    store.add_manifest(manifest)  # fetched from a peer: named from its metadata for now
    node = market(store, manifest)
    hear(node, "a", 1, NAME, adopted=False)
    hear(node, "c", 1, NAME, adopted=True)
    heartbeat(node)
    assert node.name == NAME and store.name_of(manifest.model_id) == NAME
    record = node.record()
    assert (record.name, record.adopted) == (NAME, True)


def test_a_name_chosen_later_by_a_holder_wins_over_the_names_others_adopted(
        store: ShardStore, manifest: Manifest) -> None:
    store.add_manifest(manifest)
    node = market(store, manifest)
    for peer in ("a", "c", "d"):
        hear(node, peer, 1, NAME, adopted=peer != "a")
    heartbeat(node)
    hear(node, "a", 2, "tiny:q3", adopted=False)  # `kvasird model add FILE --name tiny:q3`
    heartbeat(node)
    assert node.name == "tiny:q3" and store.name_claim(manifest.model_id) == ("tiny:q3", False)


def test_a_holder_that_chose_a_name_keeps_announcing_it_and_serves_the_agreed_one(
        store: ShardStore, manifest: Manifest, tmp_path: Path) -> None:
    store.add_manifest(manifest, "zz:mine", source=str(tmp_path / "m.gguf"))
    node = market(store, manifest)
    hear(node, "a", 1, NAME, adopted=False)
    hear(node, "b", 1, NAME, adopted=False)
    heartbeat(node)
    assert node.name == NAME
    assert (node.record().name, node.record().adopted) == ("zz:mine", False)


def test_a_node_alone_serves_the_name_its_store_lists(store: ShardStore,
                                                      manifest: Manifest) -> None:
    store.add_manifest(manifest, "tiny:q3", source="bundled:smollm2")
    node = market(store, manifest)
    assert node.name == "tiny:q3" and node.record().name == "tiny:q3"


def test_a_name_is_looked_up_among_what_peers_announce_and_two_models_claim_it(
        store: ShardStore, manifest: Manifest) -> None:
    store.add_manifest(manifest)
    node = market(store, manifest)
    hear(node, "a", 1, NAME, adopted=False)
    model_id = manifest.model_id
    assert node.named(NAME) == node.named("smollm2-135m-instruct") == [model_id]
    assert node.named(model_id[:8]) == [model_id] and node.named("tiny:q3") == []
    node.names["x"] = ("c" * 64, NAME)  # another model's holder claims the same name
    assert node.named(NAME) == sorted([model_id, "c" * 64])


def test_a_peer_that_said_goodbye_claims_no_name_any_more(
        store: ShardStore, manifest: Manifest) -> None:
    store.add_manifest(manifest)
    node = market(store, manifest)
    other = "c" * 64
    hear(node, "a", 1, NAME, adopted=False)
    node.names["x"] = (other, NAME)
    assert node.named(NAME) == sorted([manifest.model_id, other])
    hear(node, "a", 2, NAME, adopted=False, state="offline")
    assert node.named(NAME) == [other]
