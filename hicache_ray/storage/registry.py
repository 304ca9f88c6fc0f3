"""The built-in storage backends and ``create_backend``.

Backends are named in :mod:`hicache_ray.base.backends` (a ``"module:attribute"`` path each;
the ``ray`` one is an entry point of the installed package), so a name resolves in every
process without importing a module for its side effects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from hicache_ray.base.backends import load_factory
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.keys import ShardPlan
from hicache_ray.storage.base import StorageBackend, StorageStats
from hicache_ray.storage.faults import FaultyObjects
from hicache_ray.storage.file_objects import FileObjects
from hicache_ray.storage.objects import MemoryObjects, ObjectStore
from hicache_ray.storage.paged import PagedBackend

__all__ = [
    "BackendFactory",
    "NullBackend",
    "create_backend",
    "connect",
    "file_backend",
    "memory_backend",
    "null_backend",
    "with_faults",
]

BackendFactory = Callable[[StorageConfig, ShardPlan], StorageBackend]

log = logging.getLogger(__name__)


def create_backend(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    """The backend ``config.backend`` names, for this rank's ``plan``.

    Raises:
        ConfigError: no backend is registered under that name, or no model id is set.
    """
    config.check_model_id()
    factory: BackendFactory = load_factory(config.backend)
    backend = factory(config, plan)
    if not isinstance(backend, StorageBackend):
        raise ConfigError(
            "storage_backend", config.backend, "its factory returned no StorageBackend", "fix it"
        )
    return backend


class NullBackend(StorageBackend):
    """No L3: nothing exists, nothing is stored."""

    name = "none"

    def exists(self, keys: Sequence[str]) -> int:
        return 0

    def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> int:
        return 0

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor], *, owner: str = "") -> int:
        return 0

    def delete(self, keys: Sequence[str]) -> None:
        pass

    def stats(self) -> StorageStats:
        return StorageStats(backend=self.name)


def with_faults(config: StorageConfig, objects: ObjectStore) -> ObjectStore:
    """``objects`` behind the fault injector when ``config`` has fault rules."""
    return FaultyObjects(objects, config.faults, config.fault_seed) if config.faults else objects


def null_backend(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    return NullBackend()


def memory_backend(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    objects = with_faults(config, MemoryObjects())
    return PagedBackend(
        "memory", objects, plan, capacity_bytes=config.memory.capacity_bytes, scan_on_start=False
    )


def file_backend(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    """The ``file`` backend; without ``file.capacity_bytes`` it warns that nothing bounds
    its pages (a long-running server could fill the filesystem)."""
    opts = config.file
    if not opts.capacity_bytes:
        log.warning(
            "file L3 at %s has no byte limit (file.capacity_bytes = 0): its pages accumulate "
            "until the filesystem is full; set file.capacity_bytes to bound them",
            opts.root,
        )
    return PagedBackend(
        "file",
        with_faults(config, FileObjects(opts.root, opts.timeout_s)),
        plan,
        capacity_bytes=opts.capacity_bytes,
        metadata_ttl_s=opts.metadata_ttl_s,
        scan_on_start=opts.scan_on_start,
    )


def connect(storage: StorageConfig, plan: ShardPlan) -> PagedBackend:
    """The paged store ``storage`` names, for an engine's connector (SGLang, vLLM): the
    ``ray`` store joins its Ray cluster if needed."""
    backend = create_backend(storage, plan)
    if not isinstance(backend, PagedBackend):
        raise ConfigError(
            "storage_backend", storage.backend, "not a paged store", "use ray, file or memory"
        )
    return backend
