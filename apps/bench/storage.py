"""``hicache-ray bench storage``: page hashing and L3 put / get / exists throughput.

Each backend stores batches of page objects (the plan of one TP=1 rank) and is timed
beside a ceiling measured in the same run on the same bytes: for ``file``, raw pyarrow
writes and reads of files of the same payloads on the same filesystem (no header, checksum,
temporary name or verification); for ``memory``, a plain copy of the same bytes; for
``ray``, ``ray.put`` of the same payloads grouped into objects of the same size and
``ray.get`` of them copied into the same buffers (one thread; no index, ownership transfer
or verification). Ceilings and backend runs are interleaved so machine noise hits both
alike. The ``ray`` backend needs a Ray: the driver's, or a local one started here.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from apps.bench.storage_ceilings import (
    RawFiles,
    RawMemory,
    RawRay,
    ensure_ray,
    warm_object_store,
)
from apps.report import Figure, figure, fp16_kv, time_into
from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.storage_config import FileStorageOptions, RayStorageOptions, StorageConfig
from hicache_ray.base.views import byte_view
from hicache_ray.keys import ShardPlan, page_hashes, plan_shard
from hicache_ray.storage import StorageBackend, create_backend

__all__ = ["StorageBenchOptions", "run_storage_bench"]


@dataclass(frozen=True)
class StorageBenchOptions:
    backends: tuple[str, ...] = ("memory", "file")
    root: str = ""  # file backend root; empty: a fresh directory on /dev/shm (else tmp)
    num_layers: int = 8
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    batch_pages: int = 128
    repeats: int = 3
    exists_repeats: int = 200
    hash_tokens: int = 100_000

    @classmethod
    def quick(cls) -> StorageBenchOptions:
        return cls(
            num_layers=2, num_kv_heads=2, head_dim=16, batch_pages=16, repeats=2, exists_repeats=20
        )


def hash_figure(opts: StorageBenchOptions) -> Figure:
    rnd = random.Random(0)
    tokens = np.array([rnd.randrange(150_000) for _ in range(opts.hash_tokens)], dtype=np.int64)
    times: list[float] = []
    for _ in range(5):
        time_into(lambda: page_hashes(tokens, opts.page_size), times)
    return figure(
        "hash.100k_tokens_ms",
        statistics.median(times) * 1e3 * 100_000 / opts.hash_tokens,
        "ms",
        target=50,
        better="lower",
    )


def _plan(opts: StorageBenchOptions, config: StorageConfig) -> ShardPlan:
    kv = fp16_kv(opts.num_layers, opts.num_kv_heads, opts.head_dim, opts.page_size)
    memory = MemoryConfig(page_size=opts.page_size, device_tokens=opts.page_size)
    return plan_shard(kv, CacheConfig(memory=memory, storage=config))


@dataclass
class _Samples:
    """Timings of one backend's run, each beside its ceiling."""

    times: dict[str, list[float]] = field(
        default_factory=lambda: {k: [] for k in ("raw_put", "put", "raw_get", "get")}
    )
    exists_us: list[float] = field(default_factory=list)
    cold_us: list[float] = field(default_factory=list)  # ray: exists with nothing cached
    trip_us: list[float] = field(default_factory=list)  # ray: one shard round trip


def _raw_store(name: str, config: StorageConfig, root: str) -> Any:
    if name == "file":
        return RawFiles(root)
    return RawRay(config.ray.object_bytes) if name == "ray" else RawMemory()


def _backend_figures(
    name: str, opts: StorageBenchOptions, root: str, log: Callable[[str], None]
) -> list[Figure]:
    config = StorageConfig(
        backend=name,
        model_id="bench/storage",
        file=FileStorageOptions(root=root or "unused", scan_on_start=False),
        ray=RayStorageOptions(name=f"bench-{os.getpid()}"),
    )
    plan = _plan(opts, config)
    n, shape = opts.batch_pages, plan.objects[0].shape
    gen = torch.Generator().manual_seed(0)
    pages = [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(n)]
    outs = [torch.empty_like(p).fill_(0) for p in pages]
    nbytes = sum(p.nbytes for p in pages)
    raw = _raw_store(name, config, root)
    backend: StorageBackend = create_backend(config, plan)
    if name == "ray":
        warm_object_store(8 * nbytes)
    log(f"storage {name}: {opts.repeats} x {n} pages of {nbytes / n / 2**20:.2f} MiB")
    found = _Samples()
    try:
        for rep in range(opts.repeats + 1):  # repeat 0 warms up
            rec = found if rep else _Samples()
            _repeat(rep, name, opts, backend, plan, raw, pages, outs, rec)
    finally:
        backend.close()
        raw.clear()
    return _figures_of(name, found, nbytes)


def _repeat(
    rep: int,
    name: str,
    opts: StorageBenchOptions,
    backend: StorageBackend,
    plan: ShardPlan,
    raw: Any,
    pages: list[torch.Tensor],
    outs: list[torch.Tensor],
    rec: _Samples,
) -> None:
    """One repeat: raw and backend puts and gets of the same pages, then exists lookups."""
    n = len(pages)
    payloads, out_views = [byte_view(p) for p in pages], [byte_view(o) for o in outs]
    tokens = [rep * 10_000_000 + i for i in range(n * opts.page_size)]
    keys = [plan.keys(h)[0] for h in page_hashes(tokens, opts.page_size)]
    names = [f"{rep}-{i}" for i in range(n)]
    time_into(partial(raw.write, names, payloads), rec.times["raw_put"])
    _timed_batch(backend.put, keys, pages, rec.times["put"])
    if isinstance(raw, RawRay):
        raw.stage(names, payloads)
        backend.flush()  # the shards' own copies are made: reads see them
    time_into(partial(raw.read, names, out_views), rec.times["raw_get"])
    _timed_batch(backend.get, keys, outs, rec.times["get"])
    for _ in range(opts.exists_repeats):
        start = time.perf_counter()
        _check(backend.exists(keys[:128]), min(n, 128))
        rec.exists_us.append((time.perf_counter() - start) * 1e6)
    if name == "ray":
        _cold_exists(backend, plan, keys[:128], opts.exists_repeats, rec.cold_us, rec.trip_us)
    assert all(torch.equal(a, b) for a, b in zip(pages, outs, strict=True))
    backend.delete(keys)
    raw.clear()


def _figures_of(name: str, found: _Samples, nbytes: int) -> list[Figure]:
    def gbps(key: str) -> float:
        return nbytes / statistics.median(found.times[key]) / 1e9

    figures = [
        figure(
            f"storage.{name}.put.gbps",
            gbps("put"),
            "GB/s",
            ceiling=gbps("raw_put"),
            target={"file": 0.8, "ray": 0.45}.get(name),
        ),
        figure(
            f"storage.{name}.get.gbps",
            gbps("get"),
            "GB/s",
            ceiling=gbps("raw_get"),
            target={"file": 0.8, "ray": 0.8}.get(name),
        ),
        figure(
            f"storage.{name}.exists128_us",
            statistics.median(found.exists_us),
            "us",
            target={"file": 100, "ray": 200}.get(name),
            better="lower",
        ),
    ]
    if found.cold_us:
        cold = statistics.median(found.cold_us)
        trip = statistics.median(found.trip_us)
        figures.append(
            figure(
                f"storage.{name}.exists128_cold_us",
                cold,
                "us",
                ceiling=trip,
                target=1.5,
                better="lower",
            )
        )
    return figures


def _cold_exists(
    backend: StorageBackend,
    plan: ShardPlan,
    keys: list[str],
    repeats: int,
    cold_us: list[float],
    trip_us: list[float],
) -> None:
    """``exists`` with no metadata cache (every key asked of the shards), interleaved with
    the ceiling: one ``sizes`` call of the same keys to one shard (one round trip)."""
    import ray

    from hicache_ray.storage import PagedBackend

    assert isinstance(backend, PagedBackend)
    store: Any = backend.objects
    cold = PagedBackend("ray", store, plan, metadata_ttl_s=0.0, scan_on_start=False)
    shard = store.shard_handle(0)
    for _ in range(repeats):
        start = time.perf_counter()
        ray.get(shard.sizes.remote(keys))
        trip_us.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        _check(cold.exists(keys), len(keys))
        cold_us.append((time.perf_counter() - start) * 1e6)


def _timed_batch(
    op: Callable[[list[str], list[torch.Tensor]], int],
    keys: list[str],
    data: list[torch.Tensor],
    samples: list[float],
) -> None:
    start = time.perf_counter()
    got = op(keys, data)
    samples.append(time.perf_counter() - start)
    _check(got, len(keys))


def _check(got: int, expected: int) -> None:
    """Timed calls are only valid when the whole batch went through."""
    if got != expected:
        raise RuntimeError(f"storage stored or found {got} of {expected} pages; see the log")


def run_storage_bench(
    opts: StorageBenchOptions, log: Callable[[str], None] = print
) -> list[Figure]:
    figures = [hash_figure(opts)]
    started_ray = "ray" in opts.backends and ensure_ray()
    try:
        for name in opts.backends:
            figures += _run_backend(name, opts, log)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return figures


def _run_backend(name: str, opts: StorageBenchOptions, log: Callable[[str], None]) -> list[Figure]:
    if name == "file" and not opts.root:
        # NOTE: memory-backed when possible, so disk write-back (which comes and goes
        # with the page cache's dirty limits) does not swamp the comparison.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        tmp = tempfile.mkdtemp(prefix="hicache-bench-", dir=shm)
        try:
            return _backend_figures(name, opts, tmp, log)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        return _backend_figures(name, opts, opts.root, log)
    finally:
        if name == "ray":
            from actors.stores import drop_store

            drop_store(f"bench-{os.getpid()}")
