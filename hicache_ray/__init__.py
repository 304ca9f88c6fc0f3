"""hicache-ray: a three-tier KV cache (device, host, storage) for LLM serving on Ray.

The core is importable without a running Ray; see README.md for the layout. The public
names below load on first use, so ``import apps.cli`` (the CLI) can set process-wide
settings (the OpenMP wait policy) before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache_ray.cache import CacheFullError, CacheHandle, HiCache
    from hicache_ray.config import (
        CacheConfig,
        MemoryConfig,
        PrefetchConfig,
        StorageConfig,
        WriteConfig,
    )
    from hicache_ray.errors import AllocatorError, ConfigError, HiCacheError, TransferError
    from hicache_ray.layout import ModelKV, Shard, ShardKV
    from hicache_ray.stats import CacheStats

_WHERE = {
    "AllocatorError": "errors",
    "CacheConfig": "config",
    "CacheFullError": "cache",
    "CacheHandle": "cache",
    "CacheStats": "stats",
    "ConfigError": "errors",
    "HiCache": "cache",
    "HiCacheError": "errors",
    "MemoryConfig": "config",
    "ModelKV": "layout",
    "PrefetchConfig": "config",
    "Shard": "layout",
    "ShardKV": "layout",
    "StorageConfig": "config",
    "TransferError": "errors",
    "WriteConfig": "config",
}

__all__ = [
    "AllocatorError",
    "CacheConfig",
    "CacheFullError",
    "CacheHandle",
    "CacheStats",
    "ConfigError",
    "HiCache",
    "HiCacheError",
    "MemoryConfig",
    "ModelKV",
    "PrefetchConfig",
    "Shard",
    "ShardKV",
    "StorageConfig",
    "TransferError",
    "WriteConfig",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_ray' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hicache_ray.{module}"), name)
