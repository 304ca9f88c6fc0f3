"""What the vLLM connector's vLLM-free tests share: a small model, its plan, vLLM CPU caches
and block movers over them."""

from __future__ import annotations

import threading
from typing import Any

import torch

from hicache_ray.base.layout import ModelKV, Shard, ShardKV
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.integrations.vllm.blocks import BlockMover
from hicache_ray.integrations.vllm.setup import slot_views
from hicache_ray.keys import ShardPlan, plan_objects
from hicache_ray.storage import MemoryObjects, PagedBackend

LAYERS, HEADS, DIM, PAGE, BLOCKS = 3, 4, 32, 16, 12
MODEL = ModelKV(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float32")


def plan_of(tp_rank: int = 0, tp: int = 1, share_tp: tuple[int, ...] = ()) -> ShardPlan:
    kv = ShardKV(model=MODEL, shard=Shard(tp_rank=tp_rank, tp_size=tp), page_size=PAGE)
    return plan_objects(kv, StorageConfig(backend="memory", model_id="m", share_tp=share_tp))


def backend_of(plan: ShardPlan, objects: Any = None) -> PagedBackend:
    return PagedBackend("memory", objects or MemoryObjects(), plan)


def cpu_caches(seed: int, heads: int = HEADS) -> list[torch.Tensor]:
    """CPU_ATTN caches ``[blocks, H, P, 2D]`` of random KV."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, heads, PAGE, 2 * DIM, generator=g) for _ in range(LAYERS)]


def stack(mover: BlockMover, layer: int, blocks: Any) -> torch.Tensor:
    """``[n, S, P, H, D]`` of ``blocks`` of one layer of ``mover``'s caches."""
    cache = mover.layers[layer]
    key, value = slot_views("cpu_vec", cache, cache.shape[1], DIM)
    return torch.stack([key[blocks], value[blocks]], dim=1)


def mover_of(caches: list[torch.Tensor], plan: ShardPlan, backend: Any, **kw: Any) -> BlockMover:
    return BlockMover(caches, "cpu_vec", plan, backend, **kw)


class Gated(MemoryObjects):
    """A store whose reads or writes (``gate``) wait until released (a slow store, without
    sleeping)."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate, self.release = gate, threading.Event()

    def read_many(self, *args: Any, **kw: Any) -> Any:
        if self.gate == "read":
            self.release.wait(30)
        return super().read_many(*args, **kw)

    def write_many(self, *args: Any, **kw: Any) -> Any:
        if self.gate == "write":
            self.release.wait(30)
        return super().write_many(*args, **kw)
