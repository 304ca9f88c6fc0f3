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
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from apps.report import Figure, figure, fp16_kv, time_into
from hicache_ray.config import (
    CacheConfig,
    FileStorageOptions,
    MemoryConfig,
    RayStorageOptions,
    StorageConfig,
)
from hicache_ray.keys import ShardPlan, page_hashes, plan_shard
from hicache_ray.memory.host_pool import byte_view
from hicache_ray.storage import StorageBackend, create_backend
from hicache_ray.storage.file_objects import open_filesystem

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


class _RawFiles:
    """The ceiling: plain pyarrow files of the same payloads."""

    def __init__(self, root: str) -> None:
        self.fs, base = open_filesystem(root)
        self.base = f"{base}/raw-ceiling"
        self.fs.create_dir(self.base, recursive=True)

    def write(self, names: list[str], payloads: list[memoryview]) -> None:
        for name, payload in zip(names, payloads, strict=True):
            with self.fs.open_output_stream(f"{self.base}/{name}") as out:
                out.write(payload)

    def read(self, names: list[str], outs: list[memoryview]) -> None:
        for name, out in zip(names, outs, strict=True):
            with self.fs.open_input_file(f"{self.base}/{name}") as f:
                f.readinto(out)

    def clear(self) -> None:
        self.fs.delete_dir_contents(self.base, missing_dir_ok=True)


class _RawMemory:
    """The ceiling of the memory backend: one copy of the same bytes in, one out."""

    def __init__(self) -> None:
        self.stored: dict[str, np.ndarray] = {}

    def write(self, names: list[str], payloads: list[memoryview]) -> None:
        for name, payload in zip(names, payloads, strict=True):
            self.stored[name] = np.frombuffer(payload, dtype=np.uint8).copy()

    def read(self, names: list[str], outs: list[memoryview]) -> None:
        for name, out in zip(names, outs, strict=True):
            np.copyto(np.frombuffer(out, dtype=np.uint8), self.stored[name])

    def clear(self) -> None:
        self.stored.clear()


class _RawRay:
    """The ceiling of the ray backend: the same payloads in objects of the same size.

    ``write`` is ``ray.put`` in this process. ``read`` is ``ray.get`` plus a one-thread
    copy of objects another process put (any L3 read crosses processes: mapping another
    process's fresh object costs page faults that re-reading one's own does not), made
    before the timed read by a helper actor that owns them.
    """

    def __init__(self, object_bytes: int) -> None:
        import ray

        self.ray = ray
        self.object_bytes = object_bytes
        self.stored: dict[str, tuple[object, int]] = {}
        self.mine: list[object] = []
        self.helper: Any = ray.remote(num_cpus=0)(_ForeignPuts).remote()

    def _groups(self, payloads: list[memoryview]) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        for i, payload in enumerate(payloads):
            size = sum(payloads[j].nbytes for j in groups[-1])
            if groups[-1] and size + payload.nbytes > self.object_bytes:
                groups.append([])
            groups[-1].append(i)
        return groups

    def write(self, names: list[str], payloads: list[memoryview]) -> None:
        for group in self._groups(payloads):
            self.mine.append(
                self.ray.put([np.frombuffer(payloads[j], dtype=np.uint8) for j in group])
            )

    def stage(self, names: list[str], payloads: list[memoryview]) -> None:
        """Objects of the same payloads put by the helper (untimed)."""
        groups = self._groups(payloads)
        arrays = [[np.frombuffer(payloads[j], dtype=np.uint8) for j in g] for g in groups]
        refs = self.ray.get(self.helper.put.remote(arrays))[0]
        for group, ref in zip(groups, refs, strict=True):
            self.stored.update((names[j], (ref, k)) for k, j in enumerate(group))

    def read(self, names: list[str], outs: list[memoryview]) -> None:
        for payload, out in zip(self.fetch(names), outs, strict=True):
            np.copyto(np.frombuffer(out, dtype=np.uint8), payload)

    def fetch(self, names: list[str]) -> list[np.ndarray]:
        """The staged payloads of ``names`` (``ray.get`` of their objects, zero-copy)."""
        refs = list({id(self.stored[n][0]): self.stored[n][0] for n in names}.values())
        objects: dict[int, list[np.ndarray]] = dict(
            zip(map(id, refs), self.ray.get(refs), strict=True)  # type: ignore[arg-type]
        )
        return [objects[id(self.stored[n][0])][self.stored[n][1]] for n in names]

    def clear(self) -> None:
        self.stored.clear()
        self.mine.clear()
        self.ray.get(self.helper.clear.remote())


class _ForeignPuts:
    """The helper actor of :class:`_RawRay`: puts (and so owns) objects for the driver."""

    def __init__(self) -> None:
        self.refs: list[object] = []

    def put(self, groups: list[list[np.ndarray]]) -> list[list[object]]:
        import ray

        self.refs = [ray.put(group) for group in groups]
        return [self.refs]  # nested: the driver gets the references, not the values

    def clear(self) -> None:
        self.refs = []


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
    payloads = [byte_view(p) for p in pages]
    out_views = [byte_view(o) for o in outs]
    nbytes = sum(p.nbytes for p in payloads)
    raw = (
        _RawFiles(root)
        if name == "file"
        else _RawRay(config.ray.object_bytes)
        if name == "ray"
        else _RawMemory()
    )
    backend: StorageBackend = create_backend(config, plan)
    if name == "ray":
        warm_object_store(8 * nbytes)
    log(f"storage {name}: {opts.repeats} x {n} pages of {nbytes / n / 2**20:.2f} MiB")
    samples: dict[str, list[float]] = {k: [] for k in ("raw_put", "put", "raw_get", "get")}
    exists_us: list[float] = []
    cold_us: list[float] = []  # ray: exists with nothing cached, beside one shard round trip
    trip_us: list[float] = []
    try:
        for rep in range(opts.repeats + 1):  # repeat 0 warms up
            rec = samples if rep else {k: [] for k in samples}
            tokens = [rep * 10_000_000 + i for i in range(n * opts.page_size)]
            keys = [plan.keys(h)[0] for h in page_hashes(tokens, opts.page_size)]
            names = [f"{rep}-{i}" for i in range(n)]
            time_into(partial(raw.write, names, payloads), rec["raw_put"])
            _timed_batch(backend.put, keys, pages, rec["put"])
            if isinstance(raw, _RawRay):
                raw.stage(names, payloads)
                backend.flush()  # the shards' own copies are made: reads see them
            time_into(partial(raw.read, names, out_views), rec["raw_get"])
            _timed_batch(backend.get, keys, outs, rec["get"])
            if rep:
                for _ in range(opts.exists_repeats):
                    start = time.perf_counter()
                    _check(backend.exists(keys[:128]), min(n, 128))
                    exists_us.append((time.perf_counter() - start) * 1e6)
                if name == "ray":
                    _cold_exists(backend, plan, keys[:128], opts.exists_repeats, cold_us, trip_us)
            assert all(torch.equal(a, b) for a, b in zip(pages, outs, strict=True))
            backend.delete(keys)
            raw.clear()
    finally:
        backend.close()
        raw.clear()

    def gbps(key: str) -> float:
        return nbytes / statistics.median(samples[key]) / 1e9

    get_target = {"file": 0.8, "ray": 0.8}.get(name)
    put_target = {"file": 0.8, "ray": 0.45}.get(name)
    cold = []
    if cold_us:
        cold = [
            figure(
                f"storage.{name}.exists128_cold_us",
                statistics.median(cold_us),
                "us",
                ceiling=statistics.median(trip_us),
                target=1.5,
                better="lower",
            )
        ]
    return [
        figure(
            f"storage.{name}.put.gbps",
            gbps("put"),
            "GB/s",
            ceiling=gbps("raw_put"),
            target=put_target,
        ),
        figure(
            f"storage.{name}.get.gbps",
            gbps("get"),
            "GB/s",
            ceiling=gbps("raw_get"),
            target=get_target,
        ),
        figure(
            f"storage.{name}.exists128_us",
            statistics.median(exists_us),
            "us",
            target={"file": 100, "ray": 200}.get(name),
            better="lower",
        ),
        *cold,
    ]


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
    started_ray = "ray" in opts.backends and _ensure_ray()
    try:
        for name in opts.backends:
            figures += _run_backend(name, opts, log)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return figures


def warm_object_store(nbytes: int) -> None:
    """Put and free ``nbytes`` once before timing: a fresh node's shared memory costs a page
    fault per page on first touch (a one-time cost of the node, not of a put), and whichever
    run touched it first would pay for both."""
    import ray

    chunk = np.ones(32 << 20, dtype=np.uint8)
    refs = [ray.put(chunk) for _ in range(max(1, nbytes // chunk.nbytes))]
    del refs


def _ensure_ray() -> bool:
    """Start a local Ray for the ``ray`` backend if none is running (returns whether this
    call started it)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    return True


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
