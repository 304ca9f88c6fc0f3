"""Storage backends by name.

A factory takes the storage config and this rank's key plan and returns a backend; the
built-in ones are registered below, others (the Ray object store backend of ``actors``)
register themselves with :func:`register_backend` when their module is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hicache_ray.config import StorageConfig
from hicache_ray.errors import ConfigError
from hicache_ray.keys import ShardPlan
from hicache_ray.storage.base import StorageBackend, StorageStats
from hicache_ray.storage.faults import FaultyObjects
from hicache_ray.storage.file_objects import FileObjects
from hicache_ray.storage.objects import MemoryObjects, ObjectStore
from hicache_ray.storage.paged import PagedBackend

__all__ = [
    "BackendFactory",
    "NullBackend",
    "backend_names",
    "create_backend",
    "register_backend",
    "with_faults",
]

BackendFactory = Callable[[StorageConfig, ShardPlan], StorageBackend]

_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``name`` usable as ``StorageConfig.backend``; a second registration replaces."""
    _REGISTRY[name] = factory


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def create_backend(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    """The backend ``config.backend`` names, for this rank's ``plan``.

    Raises:
        ConfigError: no backend is registered under that name, or no model id is set.
    """
    config.check_model_id()
    factory = _REGISTRY.get(config.backend)
    if factory is None:
        raise ConfigError(
            "storage_backend",
            config.backend,
            "no backend registered under this name",
            f"use one of {backend_names()} (the `ray` backend registers when `actors` is imported)",
        )
    return factory(config, plan)


class NullBackend(StorageBackend):
    """No L3: nothing exists, nothing is stored."""

    name = "none"

    def exists(self, keys: Sequence[str]) -> int:
        return 0

    def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> int:
        return 0

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        return 0

    def delete(self, keys: Sequence[str]) -> None:
        pass

    def stats(self) -> StorageStats:
        return StorageStats(backend=self.name)


def with_faults(config: StorageConfig, objects: ObjectStore) -> ObjectStore:
    """``objects`` behind the fault injector when ``config`` has fault rules."""
    return FaultyObjects(objects, config.faults, config.fault_seed) if config.faults else objects


def _memory(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    objects = with_faults(config, MemoryObjects())
    return PagedBackend(
        "memory", objects, plan, capacity_bytes=config.memory.capacity_bytes, scan_on_start=False
    )


def _file(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    opts = config.file
    return PagedBackend(
        "file",
        with_faults(config, FileObjects(opts.root, opts.timeout_s)),
        plan,
        capacity_bytes=opts.capacity_bytes,
        metadata_ttl_s=opts.metadata_ttl_s,
        scan_on_start=opts.scan_on_start,
    )


register_backend("none", lambda config, plan: NullBackend())
register_backend("memory", _memory)
register_backend("file", _file)
