"""Stores have a lifecycle: list, clear, drop (API and ``hicache-ray store``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.storage import create_backend
from tests.helpers import plasma_usage, wait_until
from tests.storage.conftest import make_pages, make_plan, page_keys

ray = pytest.importorskip("ray")
stores = pytest.importorskip("actors.stores")


def _fill(name: str, pages: int) -> None:
    plan = make_plan()
    config = StorageConfig(
        backend="ray", model_id="test/model", ray=RayStorageOptions(name=name, num_shards=2)
    )
    backend = create_backend(config, plan)
    assert backend.put(page_keys(plan, pages), make_pages(plan, pages)) == pages
    backend.close()


def _mine(found: list[Any]) -> dict[str, Any]:
    return {s.name: s for s in found if s.name.startswith("life-")}


def test_list_clear_and_drop(ray_local: None) -> None:
    baseline = plasma_usage()
    _fill("life-a", 64)
    _fill("life-b", 3)
    found = _mine(stores.list_stores())
    assert set(found) == {"life-a", "life-b"}
    assert found["life-a"].shards == 2 and found["life-a"].keys == 64 and not found["life-a"].errors
    stores.clear_store(RayStorageOptions(name="life-b", num_shards=2))
    assert _mine(stores.list_stores())["life-b"].keys == 0  # cleared: the shards stay
    assert stores.drop_store("life-a") == 2 and stores.drop_store("life-b") == 2
    assert not _mine(stores.list_stores())
    assert not stores.store_exists("life-a") and stores.drop_store("life-a") == 0

    def freed() -> bool:  # the dropped shards owned every object: all freed with them
        mib, objects = plasma_usage()
        return mib <= baseline[0] and objects <= baseline[1]

    wait_until(freed, what="the dropped stores' objects to be freed")


def test_store_command(ray_local: None, tmp_path: Any, capsys: Any) -> None:
    from apps.cli import main

    _fill("life-cli", 4)
    out = tmp_path / "stores.json"
    assert main(["store", "ls", "--json", str(out)]) == 0
    listed = {s["name"]: s for s in json.loads(out.read_text())}
    assert listed["life-cli"]["keys"] == 4 and listed["life-cli"]["shards"] == 2
    assert main(["store", "clear", "life-cli"]) == 0
    assert _mine(stores.list_stores())["life-cli"].keys == 0
    assert main(["store", "drop", "life-cli"]) == 0
    assert "dropped store 'life-cli' (2 shards)" in capsys.readouterr().out
    assert main(["store", "drop", "life-cli"]) == 1  # no such store any more
    assert "no store named 'life-cli'" in capsys.readouterr().err
