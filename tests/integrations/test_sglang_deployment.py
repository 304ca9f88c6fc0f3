"""Real KV across engines: hicache-ray computes it, SGLang moves it, a Deployment reuses it.

1. a hicache-ray rank (the runtime every Deployment rank runs) prefills a prompt and stores
   its pages (file store);
2. SGLang TP=2 ranks read them through the backend, byte-equal to that rank's host pool,
   and store them through the backend into a Ray object store;
3. a hicache-ray TP=1 Deployment on that store gets every page as an L3 hit, and its output
   equals a full recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.utils import get_hash_str

from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.base.storage_config import FileStorageOptions, RayStorageOptions, StorageConfig
from hicache_ray.cache.controller import CacheController
from hicache_ray.engine.model import ReferenceModel
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.keys import plan_shard
from hicache_ray.storage import create_backend
from tests.actors.helpers import MODEL, PAGE, cache_config, prompt, recompute, store_name
from tests.helpers import wait_until
from tests.integrations.helpers import attach, host_pool, native_page, storage_config, to_native

ray = pytest.importorskip("ray")
actors = pytest.importorskip("actors")
RayObjects = pytest.importorskip("actors.ray_store").RayObjects

PROMPT = prompt(71, 12 * PAGE)
HASHES = get_hash_str(PROMPT, None, page_size=PAGE)


def _extra(**store: Any) -> dict[str, Any]:
    """SGLang's side of the namespace of ``tests.actors.helpers.cache_config``."""
    return {
        "model_id": "test4",
        "share_tp": [1, 2, 4],
        "share_pp": [1, 2],
        "num_layers": 2,
        **store,
    }


def _prefill_in_process(root: Path) -> dict[int, torch.Tensor]:
    """Prefill PROMPT on one hicache-ray rank storing to files; its host pool's pages
    ``[L, S, P, H, D]`` by page index."""
    config = CacheConfig(
        memory=MemoryConfig(page_size=PAGE, device_tokens=256),
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=StorageConfig(
            backend="file",
            model_id="test4",
            share_tp=(1, 2, 4),
            share_pp=(1, 2),
            file=FileStorageOptions(root=str(root)),
        ),
    )
    kv = ShardKV(model=MODEL.model_kv(), shard=Shard(), page_size=PAGE)
    storage = create_backend(config.storage, plan_shard(kv, config))
    ctl = CacheController(config, kv, storage=storage, host_budget_bytes=1 << 28)
    rt = RankRuntime(ctl, ReferenceModel(MODEL))
    rt.submit(GenerateRequest("prefill", PROMPT, 1))
    while rt.has_work or ctl.step().busy:
        rt.step()
        ctl.settle(timeout=30)
    tree = ctl.cache.tree
    match = tree.match_prefix(PROMPT, count_hit=False)
    host_pages = [p for node in tree.path(match.best_match_node) for p in node.host_pages or []]
    assert len(host_pages) == len(HASHES)
    pages = {i: ctl.cache.host_pool.read_object(p).clone() for i, p in enumerate(host_pages)}
    ctl.close()
    return pages


@pytest.fixture
def store(ray_local: None) -> Iterator[str]:
    name = store_name()
    yield name
    actors.drop_store(name)


def test_hicache_ray_to_sglang_to_deployment(tmp_path: Path, store: str) -> None:
    ours = _prefill_in_process(tmp_path)
    slots = torch.arange(len(HASHES) * PAGE)
    ray_extra = _extra(store="ray", ray={"name": store, "num_shards": 2})
    for rank in range(2):
        pool = host_pool(
            2, "page_head", heads=MODEL.num_kv_heads, head_dim=MODEL.head_dim, layers=(0, 2)
        )
        reader = attach(
            storage_config(_extra(store="file", file={"root": str(tmp_path)}), tp_rank=rank, tp=2),
            pool,
        )
        assert reader.batch_get_v1(HASHES, slots) == [True] * len(HASHES)
        for i, page_kv in ours.items():
            mine = page_kv[:, :, :, 2 * rank : 2 * rank + 2]
            assert torch.equal(native_page(pool, i), to_native(pool, mine)), f"rank {rank} page {i}"
        writer = attach(storage_config(ray_extra, tp_rank=rank, tp=2), pool)
        assert writer.batch_set_v1(HASHES, slots) == [True] * len(HASHES)
        writer.close()  # the store owns the pages now
    deployment = actors.Deployment.launch(
        actors.DeploymentConfig(
            name="sgl-to-hicache",
            model=MODEL,
            cache=cache_config(store),
            host_budget_bytes=16 << 20,
        )
    )
    try:
        tokens = PROMPT + prompt(72, 5)
        result = deployment.generate([GenerateRequest("follow", tokens, 8)])[0]
    finally:
        deployment.shutdown()
    assert result.storage_hit_tokens == len(PROMPT), result
    assert result.output_tokens == recompute(tokens, 8)


def test_dead_ray_store_is_a_fast_miss(store: str) -> None:
    pool = host_pool(
        1, "page_first", heads=MODEL.num_kv_heads, head_dim=MODEL.head_dim, layers=(0, 2)
    )
    RayObjects(RayStorageOptions(name=store, num_shards=1)).close()  # started and answering
    extra = _extra(store="ray", ray={"name": store, "num_shards": 1, "timeout_s": 2.0})
    backend = attach(storage_config(extra), pool)
    slots = torch.arange(4 * PAGE)
    assert backend.batch_set_v1(HASHES[:4], slots) == [True] * 4
    actors.drop_store(store)
    assert backend.batch_get_v1(HASHES[:4], slots) == [False] * 4
    assert backend.batch_set_v1(HASHES[4:8], slots) == [False] * 4
    assert backend.batch_exists(HASHES) == 0
    stats = backend.storage_stats()
    assert stats.get_failures >= 1 and stats.put_failures >= 1
    backend.close()


def test_a_store_slow_to_start_is_a_miss_until_it_answers(store: str) -> None:
    """Attaching never raises into SGLang: with a timeout shorter than a new shard's
    start-up, the attach returns, batches miss, and the store serves once it answers."""
    pool = host_pool(
        1, "page_first", heads=MODEL.num_kv_heads, head_dim=MODEL.head_dim, layers=(0, 2)
    )
    extra = _extra(store="ray", ray={"name": store, "num_shards": 1, "timeout_s": 0.5})
    backend = attach(storage_config(extra), pool)  # the new shard process is still starting
    slots = torch.arange(4 * PAGE)
    wait_until(lambda: backend.batch_set_v1(HASHES[:4], slots) == [True] * 4, 60, what="the shard")
    assert backend.batch_exists(HASHES) == 4
    backend.close()
