"""SGLang and hicache-ray share pages: one namespace, one object format, both directions.

Host pools of hicache-ray ranks (its own layouts and code) and of SGLang ranks hold the
same known KV; whatever one engine stores, the other reads back byte for byte, across TP
sizes. The model-level round trip (real KV, a Deployment's outputs) is in
``test_sglang_deployment``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.utils import get_hash_str

from hicache_ray.base.layout import ModelKV, Shard, ShardKV
from hicache_ray.base.storage_config import FileStorageOptions, StorageConfig
from hicache_ray.cache.memory import HostPool
from hicache_ray.keys import ShardPlan, plan_objects
from hicache_ray.storage import PagedBackend, create_backend
from tests.integrations.helpers import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    PAGE,
    attach,
    expected,
    fill,
    host_pool,
    page_matches,
    storage_config,
)

TOKENS = list(range(900, 900 + 3 * PAGE))
HASHES = get_hash_str(TOKENS, None, page_size=PAGE)
MODEL = ModelKV(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float32")


def _page_kv(i: int, kv: ShardKV) -> torch.Tensor:
    heads = (kv.first_head, kv.first_head + kv.local_heads)
    return expected(TOKENS[i * PAGE : (i + 1) * PAGE], kv.layer_range, heads)


def _ours(root: Path, tp: int, layout: str) -> list[tuple[ShardKV, HostPool, PagedBackend]]:
    """hicache-ray ranks: their own host pools, plans and file store client."""
    storage = StorageConfig(
        backend="file",
        model_id="sgl/test-model",
        share_tp=(1, 2, 4),
        file=FileStorageOptions(root=str(root)),
    )
    out = []
    for rank in range(tp):
        kv = ShardKV(model=MODEL, shard=Shard(tp_rank=rank, tp_size=tp), page_size=PAGE)
        plan: ShardPlan = plan_objects(kv, storage)
        backend = create_backend(storage, plan)
        assert isinstance(backend, PagedBackend)
        out.append((kv, HostPool(kv, 8, layout, layer_granule=3), backend))  # type: ignore[arg-type]
    return out


def _sglang(root: Path, tp: int, layout: str, **pool: Any) -> list[tuple[Any, Any]]:
    extra = {"store": "file", "file": {"root": str(root)}, "share_tp": [1, 2, 4]}
    ranks = []
    for rank in range(tp):
        host = host_pool(tp, layout, **pool)
        ranks.append((attach(storage_config(extra, tp_rank=rank, tp=tp), host), host))
    return ranks


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_hicache_ray_tp2_pages_read_by_sglang_tp4_and_tp1(tmp_path: Path) -> None:
    for kv, pool, backend in _ours(tmp_path, 2, "page_first"):
        for i, h in enumerate(HASHES):
            pool.write_object(i, _page_kv(i, kv))
            objects = [
                pool.read_object(i, o.local_layers, o.local_heads) for o in backend.plan.objects
            ]
            assert backend.put(backend.plan.keys(h), [t.contiguous() for t in objects]) == 2
        backend.close()
    host_pages = [3, 0, 6]
    for tp, layout, groups in ((4, "page_head", 1), (1, "page_unified", 4)):
        for rank, (backend, pool) in enumerate(_sglang(tmp_path, tp, layout, head_groups=groups)):
            assert backend.batch_get_v1(HASHES, _slots(host_pages)) == [True] * 3
            local = HEADS // tp
            for i, page in enumerate(host_pages):
                kv = expected(
                    TOKENS[i * PAGE : (i + 1) * PAGE],
                    (0, LAYERS),
                    (rank * local, (rank + 1) * local),
                )
                assert page_matches(pool, page, kv), f"TP{tp} rank {rank} page {i}"


def test_sglang_tp1_pages_read_by_hicache_ray_tp4(tmp_path: Path) -> None:
    [(backend, pool)] = _sglang(tmp_path, 1, "layer_first")
    host_pages = [7, 1, 4]
    whole = ShardKV(model=MODEL, shard=Shard(), page_size=PAGE)
    for i, page in enumerate(host_pages):
        fill(pool, page, _page_kv(i, whole))
    assert backend.batch_set_v1(HASHES, _slots(host_pages)) == [True] * 3
    backend.close()
    for kv, pool_4, ours in _ours(tmp_path, 4, "page_first_direct"):
        for i, h in enumerate(HASHES):
            buffers = [torch.empty(o.shape, dtype=kv.dtype) for o in ours.plan.objects]
            assert ours.get(ours.plan.keys(h), buffers) == len(buffers)
            for obj, buf in zip(ours.plan.objects, buffers, strict=True):
                pool_4.write_object(i, buf, obj.local_layers, obj.local_heads)
            assert torch.equal(pool_4.read_object(i), _page_kv(i, kv)), f"{kv.shard} page {i}"
