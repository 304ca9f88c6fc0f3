"""The exactness reference: greedy tokens of one prompt computed from scratch on one rank,
no cache (the demo, benchmarks, examples and tests check answers against it)."""

from __future__ import annotations

from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.engine.compose import compose_rank
from hicache_ray.engine.model import ModelConfig
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.engine.spec import DeploymentConfig

__all__ = ["recompute"]


def recompute(model: ModelConfig, tokens: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of ``tokens`` on one rank (TP=1, PP=1) with an empty cache."""
    page = 16
    need = len(tokens) + max_new_tokens
    config = CacheConfig(memory=MemoryConfig(page_size=page, device_tokens=-(-need // page) * page))
    kv = ShardKV(model=model.model_kv(), shard=Shard(), page_size=page)
    budget = 4 * need * kv.page_bytes // page + (1 << 20)
    rank = compose_rank(DeploymentConfig(model=model, cache=config, host_budget_bytes=budget))
    ctl, runtime = rank.controller, rank.runtime
    runtime.submit(GenerateRequest("reference", tokens, max_new_tokens))
    try:
        while True:
            for result in runtime.step().results:
                if result.error is not None:
                    raise ValueError(f"the reference run refused the prompt: {result.error}")
                return result.output_tokens
    finally:
        ctl.close()
