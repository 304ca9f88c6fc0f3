"""Builders of the deployment tests: configs sharing one L3 store, prompts, references."""

from __future__ import annotations

import itertools

import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.engine import reference
from hicache_ray.engine.model import ModelConfig

PAGE = 4
# Four KV heads, so TP=1, 2 and 4 all tile them; two layers, so PP=2 holds one each.
MODEL = ModelConfig(
    name="test4", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4
)
_names = itertools.count()


def store_name() -> str:
    return f"deploy{next(_names)}"


def cache_config(store: str | None, *, device_tokens: int = 512) -> CacheConfig:
    """Every test deployment's cache: small pools; an L3 shared by TP 1/2/4 and PP 1/2."""
    storage = StorageConfig(backend="none")
    if store is not None:
        storage = StorageConfig(
            backend="ray",
            model_id="test4",
            share_tp=(1, 2, 4),
            share_pp=(1, 2),
            ray=RayStorageOptions(name=store, num_shards=2),
        )
    return CacheConfig(
        memory=MemoryConfig(page_size=PAGE, device_tokens=device_tokens),
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=storage,
    )


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


def recompute(tokens: list[int], max_new: int) -> list[int]:
    """Greedy tokens of a no-cache TP=1 run in this process."""
    return reference.recompute(MODEL, tokens, max_new)
