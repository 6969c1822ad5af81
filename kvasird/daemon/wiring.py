"""What the node hands the gateway and the admin API: narrow views built from its services.

The node is the one place that knows every service; the gateway and the admin API get
callables that read the node's state anew on each call (settlement and the receipt
exchange start after both are built), never the node itself.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from kvasird.admin.server import AdminNode
from kvasird.daemon import earnings
from kvasird.gateway import Gateway
from kvasird.gateway.payment import Settling
from kvasird.gateway.service import Loader
from kvasird.gateway.status import NodeView
from kvasird.inference.api import Generator
from kvasird.model.ref import ModelRef

if TYPE_CHECKING:
    from kvasird.daemon.node import Node
    from kvasird.model.manifest import Manifest


def gateway_of(node: Node) -> Gateway:
    """The node's gateway of its [market] model: tokenizer and chat template from the
    model's manifest (the market imports it, or fetches it by model id from the peers
    that serve the model), so any node is a gateway, one holding no unit included;
    generation across the swarm (the node's SwarmGenerator), or with the whole model
    loaded here when [gateway] local (which needs the GGUF file on this machine).
    """
    cfg = node.config
    served = bool(cfg.market.model)
    load = _local_loader(node) if served and cfg.gateway.local else None
    return Gateway(
        cfg.gateway,
        node=node_view(node),
        settling=settling_of(node),
        free_local=cfg.free_local_in_effect(),
        generator=node.inference.generator if served and load is None else None,
        model=partial(_manifest, node) if served else None,
        waiting=partial(_waits, node) if served else None,
        load=load,
        config_path=str(node.home.config),
    )


def _local_loader(node: Node) -> Loader:
    """Loads the whole [market] model here, from its GGUF file, for [gateway] local."""
    from kvasird.inference.local import LocalGenerator  # deferred: loads ggml

    cfg = node.config

    def load(model_id: str) -> Generator:
        path = ModelRef.parse(cfg.market.model, where="market.model").gguf()
        return LocalGenerator.open(
            path,
            model_id,
            node.shards.store.name_of(model_id) or _label(path),
            threads=cfg.compute.threads,
            kv_tokens=cfg.gateway.kv_tokens,
        )

    return load


def node_view(node: Node) -> NodeView:
    return NodeView(
        status=node.status,
        peers=node.p2p.peers.snapshot,
        coverage=node.market.coverage,
        shards=node.shards.view,
        earnings=partial(earnings.summary, node),
        checks=node.inference.spot.status,
        serving=lambda: node.inference.status()["serving"],
    )


def settling_of(node: Node) -> Settling:
    def layers() -> int:
        return node.market.model.n_layer if node.market.model else 1

    return Settling(
        settlement=lambda: node.settlement,
        exchange=lambda: node.exchange,
        me=node.p2p.peer_id,
        layers=layers,
    )


def admin_of(node: Node) -> AdminNode:
    return AdminNode(
        view=node_view(node),
        dialer=node.p2p.dialer,
        settlement=lambda: node.settlement,
        health=node.gateway.health if node.config.gateway.enabled else None,
    )


def _manifest(node: Node) -> Manifest | None:
    """The manifest of the node's [market] model, once the market has it in the shard store
    (imported from the file, or fetched by model id from a peer and checked against the id)."""
    model = node.market.model
    return None if model is None else node.shards.store.manifest(model.model_id)


def _waits(node: Node) -> str:
    """What a node's gateway waits for before the market has the model's manifest."""
    wanted = ModelRef.parse(node.config.market.model)
    if not wanted.from_peers:
        return "importing the model into the shard store (its file is read and hashed once)"
    model = f"model {wanted.value[:16] if wanted.kind == 'id' else wanted.value}"
    peers = len(node.p2p.peers)
    if not peers:
        return (
            f"waiting for peers, to fetch the manifest of {model} from one that serves "
            "it: this node has none yet (check [p2p] bootstrap in its kvasird.toml, and "
            "that the node it names is running)"
        )
    if not (node.market.announcers.get(wanted.value) or node.market.named(wanted.value)):
        return (
            f"waiting for a peer serving {model}: none of this node's {peers} peers "
            "announces it yet (check that a node holding the model is online, and "
            "`kvasird coverage` there)"
        )
    return (
        f"fetching the manifest of {model} (tokenizer, chat template) from the peers that serve it"
    )


def _label(path: Path) -> str:
    from kvasird.compute.ggufview import GGUFFile
    from kvasird.model.names import human_name

    return human_name(GGUFFile(path).metadata, path.name)
