"""On CUDA (``make gpu-check``): pools and model on the GPU, pinned L2 with side-stream
copies, reuse from every tier equal to recompute; with two GPUs, a TP=2 deployment whose
model all-reduces run over NCCL. Skipped on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.engine.compose import RankPlace, compose_rank
from hicache_ray.engine.model import preset
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.storage import MemoryObjects
from tests.engine.test_runtime import run

pytestmark = pytest.mark.gpu
MODEL = preset("tiny4")
PAGE = 4


def _runtime(objects: MemoryObjects, device: torch.device) -> RankRuntime:
    config = CacheConfig(
        memory=MemoryConfig(page_size=PAGE, device_tokens=256),
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=StorageConfig(backend="memory", model_id="tiny4"),
    )
    deployment = DeploymentConfig(model=MODEL, cache=config, host_budget_bytes=1 << 28)
    return compose_rank(deployment, RankPlace(device=device), objects=objects).runtime


def test_reuse_from_every_tier_on_cuda_equals_recompute() -> None:
    cuda = torch.device("cuda")
    objects = MemoryObjects()
    tokens = list(range(3, 43))
    rt = _runtime(objects, cuda)
    assert rt.ctl.cache.device_pool.layer(0)[0].is_cuda
    assert rt.ctl.cache.host_pool.buffers[0].is_pinned()
    first = run(rt, GenerateRequest("a", tokens, 8))
    l1 = run(rt, GenerateRequest("b", tokens, 8))
    assert l1.device_hit_tokens > 0 and l1.output_tokens == first.output_tokens
    rt.ctl.settle(timeout=30)
    cache = rt.ctl.cache
    cache.device_pool.allocator.free(cache.tree.evict_device(cache.tree.num_device_pages))
    l2 = run(rt, GenerateRequest("c", tokens, 8))
    assert l2.host_hit_tokens > 0 and l2.output_tokens == first.output_tokens
    rt.ctl.settle(timeout=30)
    rt.ctl.close()
    fresh = _runtime(objects, cuda)  # a new rank: only L3 holds the prefix
    l3 = run(fresh, GenerateRequest("d", tokens, 8))
    assert l3.storage_hit_tokens > 0 and l3.output_tokens == first.output_tokens
    fresh.ctl.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two ranks needs 2 GPUs")
def test_tp2_on_two_gpus_uses_nccl_and_equals_recompute(ray_local: None) -> None:
    actors = pytest.importorskip("actors")
    from hicache_ray.engine.reference import recompute

    config = actors.DeploymentConfig(
        name="gpu-tp2",
        model=MODEL,
        tp_size=2,
        gpus_per_rank=1,
        cache=CacheConfig(memory=MemoryConfig(page_size=PAGE, device_tokens=256)),
    )
    deployment = actors.Deployment.launch(config)
    try:
        tokens = list(range(5, 45))
        result = deployment.generate([GenerateRequest("g", tokens, 8)])[0]
        backends = [r.model_backend for r in deployment.stats().ranks]
    finally:
        deployment.shutdown()
    assert backends == ["nccl", "nccl"]
    assert result.output_tokens == recompute(MODEL, tokens, 8)
