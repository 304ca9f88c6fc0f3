"""The exactness reference: greedy tokens of one prompt computed from scratch, no cache."""

from __future__ import annotations

from hicache_ray.config import CacheConfig, MemoryConfig
from hicache_ray.controller import CacheController
from hicache_ray.layout import Shard, ShardKV
from hicache_ray.model import ModelConfig, ReferenceModel
from hicache_ray.runtime import GenerateRequest, RankRuntime

__all__ = ["recompute"]


def recompute(model: ModelConfig, tokens: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of ``tokens`` on one rank (TP=1, PP=1) with an empty cache."""
    page = 16
    need = len(tokens) + max_new_tokens
    config = CacheConfig(memory=MemoryConfig(page_size=page, device_tokens=-(-need // page) * page))
    kv = ShardKV(model=model.model_kv(), shard=Shard(), page_size=page)
    ctl = CacheController(
        config, kv, host_budget_bytes=4 * need * kv.page_bytes // page + (1 << 20)
    )
    runtime = RankRuntime(ctl, ReferenceModel(model))
    runtime.submit(GenerateRequest("reference", tokens, max_new_tokens))
    try:
        while True:
            for result in runtime.step().results:
                if result.error is not None:
                    raise ValueError(f"the reference run refused the prompt: {result.error}")
                return result.output_tokens
    finally:
        ctl.close()
