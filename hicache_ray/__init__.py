"""hicache-ray: a three-tier KV cache (device, host, storage) for LLM serving on Ray.

The core is importable without a running Ray; see README.md for the layout. The public
names below load on first use, so ``import apps.cli`` (the CLI) can set process-wide
settings (the OpenMP wait policy) before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig, WriteConfig
    from hicache_ray.base.errors import AllocatorError, ConfigError, HiCacheError, TransferError
    from hicache_ray.base.layout import ModelKV, Shard, ShardKV
    from hicache_ray.base.stats import CacheStats
    from hicache_ray.base.storage_config import StorageConfig
    from hicache_ray.cache.handle import CacheFullError, CacheHandle
    from hicache_ray.cache.hicache import HiCache

_WHERE = {
    "AllocatorError": "base.errors",
    "CacheConfig": "base.config",
    "CacheFullError": "cache.handle",
    "CacheHandle": "cache.handle",
    "CacheStats": "base.stats",
    "ConfigError": "base.errors",
    "HiCache": "cache.hicache",
    "HiCacheError": "base.errors",
    "MemoryConfig": "base.config",
    "ModelKV": "base.layout",
    "PrefetchConfig": "base.config",
    "Shard": "base.layout",
    "ShardKV": "base.layout",
    "StorageConfig": "base.config",
    "TransferError": "base.errors",
    "WriteConfig": "base.config",
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
