"""Pages written by one TP / PP layout are read back, byte for byte, by another.

No model: each rank's host pool is filled with a known function of (layer, head, token,
slot), written to L3 through its plan, and read back by ranks of another layout into pools
of their own layout; every byte must be what that rank would have computed itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.layout import ModelKV, Shard, ShardKV
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.cache.memory import HostPool
from hicache_ray.keys import ShardPlan, page_hashes, plan_shard
from hicache_ray.storage import MemoryObjects, PagedBackend

PAGE = 4
TOKENS = list(range(1000, 1000 + 3 * PAGE))  # three pages
MODEL = ModelKV(num_layers=4, num_kv_heads=8, head_dim=4, dtype="float32")
CONFIG = CacheConfig(
    memory=MemoryConfig(page_size=PAGE, device_tokens=64, layer_granule=2),
    storage=StorageConfig(backend="memory", model_id="hetero", share_tp=(1, 2, 4), share_pp=(1, 2)),
)


def _expected(kv: ShardKV, page: int) -> torch.Tensor:
    """[L, S, P, H, D] of this rank for page ``page`` of TOKENS (exact in float32)."""
    first_layer, end_layer = kv.layer_range
    layer = torch.arange(first_layer, end_layer).view(-1, 1, 1, 1, 1)
    slot = torch.arange(kv.kv_slots).view(1, -1, 1, 1, 1)
    token = torch.tensor(TOKENS[page * PAGE : (page + 1) * PAGE]).view(1, 1, -1, 1, 1)
    head = torch.arange(kv.first_head, kv.first_head + kv.local_heads).view(1, 1, 1, -1, 1)
    dim = torch.arange(kv.slot_dim).view(1, 1, 1, 1, -1)
    value = (((layer * 16 + head) * 2 + slot) * 4096 + token) * 8 + dim
    return value.to(torch.float32)


def _shards(tp: int, pp: int) -> list[ShardKV]:
    return [
        ShardKV(
            model=MODEL, shard=Shard(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp), page_size=PAGE
        )
        for p in range(pp)
        for t in range(tp)
    ]


def _ranks(tp: int, pp: int, layout: str) -> Iterator[tuple[ShardKV, HostPool, ShardPlan]]:
    for kv in _shards(tp, pp):
        pool = HostPool(kv, 8, layout, layer_granule=2)  # type: ignore[arg-type]
        yield kv, pool, plan_shard(kv, CONFIG)


def _write(backend: PagedBackend, tp: int, pp: int, layout: str) -> None:
    for kv, pool, plan in _ranks(tp, pp, layout):
        for page, h in enumerate(page_hashes(TOKENS, PAGE)):
            pool.write_object(page, _expected(kv, page))
            writes = [(k, o) for k, o in zip(plan.keys(h), plan.objects, strict=True) if o.writer]
            objects = [pool.read_object(page, o.local_layers, o.local_heads) for _, o in writes]
            assert backend.put([k for k, _ in writes], [t.contiguous() for t in objects]) == len(
                writes
            )


def _read_and_check(backend: PagedBackend, tp: int, pp: int, layout: str) -> None:
    for kv, pool, plan in _ranks(tp, pp, layout):
        for page, h in enumerate(page_hashes(TOKENS, PAGE)):
            keys = plan.keys(h)
            buffers = [torch.empty(o.shape, dtype=kv.dtype) for o in plan.objects]
            assert backend.get(keys, buffers) == len(keys), f"{kv.shard} page {page}: miss"
            for obj, buf in zip(plan.objects, buffers, strict=True):
                pool.write_object(page, buf, obj.local_layers, obj.local_heads)
            assert torch.equal(pool.read_object(page), _expected(kv, page)), f"{kv.shard} {page}"


@pytest.mark.parametrize(
    ("writer", "reader"),
    [((2, 1), (4, 1)), ((2, 1), (1, 1)), ((4, 1), (2, 1)), ((1, 2), (1, 1)), ((1, 1), (2, 2))],
)
@pytest.mark.parametrize(
    "layouts", [("page_first", "layer_first"), ("layer_first", "page_first_direct")]
)
def test_pages_cross_tp_and_pp_layouts_byte_for_byte(writer, reader, layouts) -> None:
    backend = PagedBackend("memory", MemoryObjects(), plan_shard(_shards(1, 1)[0], CONFIG))
    _write(backend, *writer, layouts[0])
    _read_and_check(backend, *reader, layouts[1])


def test_a_different_namespace_gets_no_hits() -> None:
    backend = PagedBackend("memory", MemoryObjects(), plan_shard(_shards(1, 1)[0], CONFIG))
    _write(backend, 2, 1, "page_first")
    other = CacheConfig(
        memory=CONFIG.memory,
        storage=StorageConfig(
            backend="memory",
            model_id="hetero",
            share_tp=(1, 2, 4),
            share_pp=(1, 2),
            model_revision="v2",
        ),
    )
    kv = _shards(4, 1)[0]
    plan = plan_shard(kv, other)
    assert backend.exists(plan.keys(page_hashes(TOKENS, PAGE)[0])) == 0
