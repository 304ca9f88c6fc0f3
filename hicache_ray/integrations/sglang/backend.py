"""hicache-ray's L3 as an SGLang HiCache storage backend (SGLang 0.5.23, ``dynamic``).

Launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache-ray",
        "module_path": "hicache_ray.integrations.sglang", "class_name": "HiCacheRayStorage",
        "interface_v1": 1, "store": "ray", "ray": {"name": "default"}, "share_tp": [1, 2, 4]}'

SGLang builds :class:`HiCacheRayStorage` with its ``HiCacheStorageConfig`` and registers
its host pool; the backend then derives this rank's shard from the pool, plans its objects
with SGLang's unified keys (``{page_hash}_{ukv1-digest}_L{a}-{b}[_H{g}]``: the same names
hicache-ray deployments use) and opens the store. Each page SGLang moves is one object per
(layer chunk, head group) of this rank, framed and checksummed like every hicache-ray page;
a page whose objects are not all read and verified is a miss (SGLang's contract), never an
error. Options: :class:`~hicache_ray.integrations.sglang.setup.SGLangStoreOptions`.

Threading: SGLang calls reads from its prefetch threads and writes from its backup thread
at once; the store is thread-safe and each thread stages through its own buffer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from hicache_ray.base.views import byte_view
from hicache_ray.base.workers import started_pool
from hicache_ray.integrations.sglang.host_layouts import HostGeometry, flat_page_buffer, object_view
from hicache_ray.integrations.sglang.setup import (
    host_geometry,
    parse_options,
    shard_of,
)
from hicache_ray.keys import ShardPlan, plan_objects
from hicache_ray.storage import PagedBackend, StorageStats
from hicache_ray.storage.page_format import checksum
from hicache_ray.storage.registry import connect

__all__ = ["HiCacheRayStorage"]

log = logging.getLogger(__name__)

_GIB = float(1 << 30)
# Staging copies (host layout <-> object order) of one batch run on this many threads:
# strided copies are bound by memory latency, and torch releases the GIL while copying.
_COPY_THREADS = 3
# One page of the batch: the buffer that holds it (the host pool's kv_buffer, or a flat
# page of the generic path viewed as a one-page pool) and the page's index in it.
_PageAt = Callable[[int], tuple[torch.Tensor, int]]


class HiCacheRayStorage(HiCacheStorage):  # type: ignore[misc]  # sglang has no types
    """SGLang's storage interface over a hicache-ray store (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.options = parse_options(storage_config.extra_config)
        self.writer = bool(storage_config.is_storage_writer)
        self._metrics_on = bool(storage_config.enable_storage_metrics)
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self._metrics_lock = threading.Lock()
        self._staging = threading.local()
        self._copiers: ThreadPoolExecutor | None = None
        self._backend: PagedBackend | None = None
        self._plan: ShardPlan | None = None
        self._geometry: HostGeometry | None = None

    # ------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Derive this rank's shard and key plan from the host pool and open the store."""
        super().register_mem_pool_host(mem_pool_host)
        self.close()
        geometry = host_geometry(mem_pool_host, bool(self.storage_config.is_mla_model))
        kv, storage = shard_of(self.storage_config, mem_pool_host, geometry, self.options)
        plan = plan_objects(kv, storage)
        self._backend = connect(storage, plan)
        self._plan, self._geometry = plan, geometry
        self._copiers = started_pool(_COPY_THREADS, "hicache-sglang-copy")
        log.info(
            "hicache-ray storage %s: %d objects per page (%s), namespace %s",
            storage.backend,
            len(plan.objects),
            ", ".join(o.suffix.split("_", 1)[1] for o in plan.objects),
            plan.digest,
        )

    @property
    def plan(self) -> ShardPlan:
        """This rank's objects per page (after :meth:`register_mem_pool_host`)."""
        if self._plan is None:
            raise RuntimeError("register_mem_pool_host() has not been called")
        return self._plan

    @property
    def backend(self) -> PagedBackend:
        if self._backend is None:
            raise RuntimeError("register_mem_pool_host() has not been called")
        return self._backend

    # ------------------------------------------------------------ zero-copy (v1)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._in_pool(self._get, keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._in_pool(self._set, keys, host_indices)

    def _in_pool(
        self, move: Callable[[Sequence[str], _PageAt], int], keys: list[str], slots: torch.Tensor
    ) -> list[bool]:
        """``move`` the pages of ``keys`` at host-pool ``slots``; per key, whether it moved."""
        pages = self._host_pages(keys, slots)
        buffer = self.mem_pool_host.kv_buffer
        done = move(keys, lambda i: (buffer, pages[i]))
        return [i < done for i in range(len(keys))]

    # ------------------------------------------------------------ generic (flat pages)

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        flats = self._flat_pages(keys, target_locations, "target_locations")
        done = self._get(keys, lambda i: (flats[i], 0))
        return [target_locations[i] if i < done else None for i in range(len(keys))]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        flats = self._flat_pages(keys, values, "values")
        return self._set(keys, lambda i: (flats[i], 0)) == len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        k = len(self.plan.objects)
        return self.backend.exists(self._object_keys(keys)) // k

    # ------------------------------------------------------------ lifecycle

    def clear(self) -> None:
        """Delete this rank's objects of this namespace from the store (other models',
        dtypes', grids' and ranks' pages stay)."""
        backend, plan = self.backend, self.plan
        mine = [key for key, _, _ in backend.objects.scan() if plan.spec_of(key) is not None]
        for start in range(0, len(mine), 1024):
            backend.delete(mine[start : start + 1024])
        log.info("hicache-ray storage: cleared %d objects of namespace %s", len(mine), plan.digest)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GiB/s per batch), or
        None when SGLang's storage metrics are off."""
        if not self._metrics_on:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            drained = {name: list(values) for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        return StorageMetrics(**drained)

    def storage_stats(self) -> StorageStats:
        """hicache-ray's counters of this rank's store client (pages, bytes, misses,
        corrupt and refused pages, failures)."""
        return self.backend.stats()

    def close(self) -> None:
        """Wait for the store to own what was written, then close the client."""
        if self._copiers is not None:
            self._copiers.shutdown(wait=True)
            self._copiers = None
        if self._backend is not None:
            backend, self._backend = self._backend, None
            backend.flush()
            backend.close()

    # ------------------------------------------------------------ plumbing

    def _object_keys(self, keys: Sequence[str]) -> list[str]:
        if not isinstance(keys, list | tuple):
            raise ValueError(f"keys must be a list of page hashes, got {type(keys).__name__}")
        suffixes = [obj.suffix for obj in self.plan.objects]
        return [f"{h}_{s}" for h in keys for s in suffixes]  # checked by the backend

    def _host_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        """Host-pool page of each key, after checking ``host_indices`` covers whole pages."""
        pool, p = self.mem_pool_host, self.mem_pool_host.page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise ValueError("host_indices must be a 1-D tensor of host token slots")
        if host_indices.numel() != len(keys) * p:
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * p} host slots, got {host_indices.numel()}"
            )
        if not len(keys):
            return []
        slots = host_indices.to("cpu", torch.int64).view(len(keys), p)
        starts = slots[:, 0]
        whole = (slots - starts[:, None] == torch.arange(p)).all()
        if (
            not whole
            or bool((starts % p).any())
            or starts.min() < 0
            or starts.max() + p > pool.size
        ):
            raise ValueError(
                f"host_indices must be whole pages of {p} slots inside the {pool.size}-slot pool"
            )
        pages: list[int] = (starts // p).tolist()
        return pages

    def _flat_pages(self, keys: Sequence[str], flats: Any, what: str) -> list[torch.Tensor]:
        geometry = self._geometry
        assert geometry is not None
        if not isinstance(flats, list | tuple) or len(flats) != len(keys):
            raise ValueError(f"{what} must be a list of one flat page per key")
        dtype = self.mem_pool_host.kv_buffer.dtype
        out = []
        for i, flat in enumerate(flats):
            if not isinstance(flat, torch.Tensor) or flat.dtype != dtype or flat.is_cuda:
                raise ValueError(f"{what}[{i}] must be a CPU {dtype} tensor")
            out.append(flat_page_buffer(geometry, flat))
        return out

    def _views(self, keys: Sequence[str], page_at: _PageAt) -> list[torch.Tensor]:
        geometry = self._geometry
        assert geometry is not None
        views = []
        for i in range(len(keys)):
            buffer, page = page_at(i)
            for obj in self.plan.objects:
                views.append(object_view(buffer, geometry, page, obj.local_layers, obj.local_heads))
        return views

    def _buffers(
        self, views: list[torch.Tensor], *, strided_ok: bool
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """One object-shaped tensor per view: the view itself when it has the object's
        shape and is contiguous, or (``strided_ok``: reads, which fill a strided place in
        one pass) strided; else a slice of this thread's staging, marked True."""
        specs = self.plan.objects
        dtype = self.mem_pool_host.kv_buffer.dtype
        shapes = [specs[j % len(specs)].shape for j in range(len(views))]
        staged = [
            not (v.is_contiguous() or (strided_ok and tuple(v.shape) == shape))
            for v, shape in zip(views, shapes, strict=True)
        ]
        need = sum(v.numel() for v, s in zip(views, staged, strict=True) if s)
        arena = self._arena(need, dtype)
        out, offset = [], 0
        for view, shape, stage in zip(views, shapes, staged, strict=True):
            if stage:
                out.append(arena[offset : offset + view.numel()].view(shape))
                offset += view.numel()
            else:
                out.append(view if view.shape == shape else view.view(shape))
        return out, staged

    def _arena(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        arena: torch.Tensor | None = getattr(self._staging, "arena", None)
        if arena is None or arena.dtype != dtype or arena.numel() < numel:
            arena = torch.empty(max(numel, 1), dtype=dtype)
            self._staging.arena = arena
        return arena

    def _get(self, keys: Sequence[str], page_at: _PageAt) -> int:
        """Read the leading pages into place; returns how many were read and verified."""
        start = time.perf_counter()
        object_keys = self._object_keys(keys)
        views = self._views(keys, page_at)
        buffers, staged = self._buffers(views, strided_ok=True)
        k = len(self.plan.objects)
        done = self.backend.get(object_keys, buffers) // k
        copies = [(views[j], buffers[j].view(views[j].shape)) for j in range(done * k) if staged[j]]

        def place(first: int, step: int) -> None:
            for dst, src in copies[first::step]:
                dst.copy_(src)

        self._spread(place, len(copies))
        self._record("prefetch", done, start)
        return done

    def _set(self, keys: Sequence[str], page_at: _PageAt) -> int:
        """Store the leading pages; returns how many are stored (all of them on an MLA rank
        that is not the writer, which stores nothing)."""
        if not self.writer:
            return len(keys)
        start = time.perf_counter()
        object_keys = self._object_keys(keys)
        views = self._views(keys, page_at)
        buffers, staged = self._buffers(views, strided_ok=False)
        digests = [""] * len(views)

        def stage(first: int, step: int) -> None:
            # Each object is copied out of the pool and hashed while still in cache.
            for j in range(first, len(views), step):
                if staged[j]:
                    buffers[j].view(views[j].shape).copy_(views[j])
                digests[j] = checksum(byte_view(buffers[j]))

        self._spread(stage, len(views))
        done = self.backend.put(object_keys, buffers, digests) // len(self.plan.objects)
        self._record("backup", done, start)
        return done

    def _spread(self, job: Callable[[int, int], None], count: int) -> None:
        """``job(first, step)`` (items ``first, first + step, ...`` of ``count``) on the copy
        threads; torch and xxhash release the GIL while copying and hashing."""
        copiers = self._copiers
        if copiers is None or count < 2 * _COPY_THREADS:
            job(0, 1)
            return
        futures = [copiers.submit(job, i, _COPY_THREADS) for i in range(_COPY_THREADS)]
        for future in futures:
            future.result()

    def _record(self, kind: str, pages: int, start: float) -> None:
        if not self._metrics_on or not pages:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        gib = pages * sum(obj.num_bytes for obj in self.plan.objects) / _GIB
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gib / seconds)
