"""Files the compute engine loads: the original GGUF, or slices assembled from the store."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from kvasird.compute.stage import Stage
from kvasird.model.distribution import ShardService, slice_specs
from kvasird.home import Home
from kvasird.model.manifest import HEAD, Unit
from kvasird.model.store import ShardStore
from kvasird_dev.testmodels import make_model


def test_slice_specs_group_units_into_runs() -> None:
    units = [HEAD, Unit("layer", 0), Unit("layer", 1), Unit("layer", 3),
             Unit("expert", 2, 4), Unit("expert", 2, 5), Unit("expert", 2, 7)]
    assert slice_specs(units) == ["head", "layers=0:2,no-experts", "layers=3:4,no-experts",
                                  "experts=2:4:6", "experts=2:7:8"]


def test_engine_on_slices_from_the_store_matches_the_original(tmp_path: Path) -> None:
    original = make_model(tmp_path / "moe.gguf", n_layer=2, n_expert=4, n_expert_used=2)
    copy = tmp_path / "copy.gguf"
    shutil.copy(original, copy)
    home = Home(tmp_path / "home")
    home.root.mkdir()
    store = ShardStore.open(home)
    manifest = store.import_gguf(copy)
    shards = ShardService(p2p=None, store=store)  # type: ignore[arg-type]  # no network needed
    everything = list(manifest.unit_sizes)
    assert shards.model_files(manifest.model_id, everything) == [copy]  # no copy made
    copy.unlink()  # now only the verified pieces in the store remain
    slices = shards.model_files(manifest.model_id, everything)
    assert len(slices) > 1 and all(p.parent.name == manifest.model_id for p in slices)
    tokens = np.array([1, 5, 9, 2], dtype=np.int32)

    def logits(sources: list[Path] | Path) -> np.ndarray:
        stage = Stage.load(sources, threads=1)
        with stage.open_session() as session:
            out = stage.forward(session, tokens, logits="all")
        stage.close()
        return out

    np.testing.assert_array_equal(logits(slices), logits(original))
