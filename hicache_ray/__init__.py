"""hicache-ray: a three-tier KV cache (device, host, storage) for LLM serving on Ray.

The core is importable without a running Ray; see README.md for the layout.
"""

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
