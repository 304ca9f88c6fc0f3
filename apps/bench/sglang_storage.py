"""``hicache-ray bench storage --backend sglang``: the SGLang backend on the Ray object store.

One SGLang rank of a Llama-3-8B-like model at TP=4 in a fleet of TP 4 and 8 (32 layers,
2 of 8 KV heads, head dim 128, 32-token pages, bfloat16: 1 MiB per page, stored as two
512 KiB head-group objects) moves batches of 128 pages between its host pool (SGLang's
``page_first`` layout) and the store, through the zero-copy path (``batch_set_v1`` /
``batch_get_v1``) and the generic one (``batch_set`` / ``batch_get`` of flat pages). The
ceiling, measured in the same run and interleaved with it, is the raw Ray object store on
the same object bytes: ``ray.put`` of them grouped into objects of the same size, and
``ray.get`` plus one copy of objects another process put (see ``bench/storage.py``).

The host pool is a plain object with the attributes the backend reads (the tests drive the
same code with SGLang's own pools), so the benchmark runs wherever SGLang's storage module
imports.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from apps.bench.storage_ceilings import RawRay, ensure_ray, warm_object_store
from apps.report import Figure, figure
from hicache_ray.base.storage_config import RayStorageOptions
from hicache_ray.base.views import byte_view
from hicache_ray.integrations.sglang.host_layouts import HostGeometry, buffer_shape
from hicache_ray.keys import page_hashes

__all__ = ["SGLangBenchOptions", "run_sglang_bench"]


@dataclass(frozen=True)
class SGLangBenchOptions:
    layout: str = "page_first"
    num_layers: int = 32
    local_heads: int = 2
    tp_size: int = 4
    share_tp: tuple[int, ...] = (4, 8)
    head_dim: int = 128
    page_size: int = 32
    batch_pages: int = 128
    repeats: int = 5  # medians of five: background shard copies make single puts noisy

    @classmethod
    def quick(cls) -> SGLangBenchOptions:
        return cls(num_layers=2, head_dim=16, page_size=16, batch_pages=16, repeats=2)


class _HostPool:
    """The attributes of an SGLang host pool that the backend reads."""

    def __init__(self, opts: SGLangBenchOptions) -> None:
        geometry = HostGeometry(
            layout=opts.layout,
            is_mla=False,
            page_size=opts.page_size,
            layers=opts.num_layers,
            heads=opts.local_heads,
            head_dim=opts.head_dim,
        )
        self.layout = opts.layout
        self.page_size = opts.page_size
        self.layer_num = opts.num_layers
        self.head_num = opts.local_heads
        self.head_dim = opts.head_dim
        self.start_layer, self.end_layer = 0, opts.num_layers
        self.size = 2 * opts.batch_pages * opts.page_size  # two batches' room
        shape = buffer_shape(geometry, self.size // opts.page_size)
        self.kv_buffer = torch.randn(shape).to(torch.bfloat16)


class _Config:
    """SGLang's ``HiCacheStorageConfig`` fields that the backend reads."""

    def __init__(self, opts: SGLangBenchOptions, store: str) -> None:
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = 0, opts.tp_size, 0, 1
        self.attn_cp_rank, self.attn_cp_size, self.dcp_size = 0, 1, 1
        self.is_mla_model, self.is_storage_writer = False, True
        self.enable_storage_metrics = False
        self.model_name, self.tp_lcm_size = "bench/llama-3-8b", None
        self.extra_config = {
            "interface_v1": 1,
            "store": "ray",
            "ray": {"name": store},
            "share_tp": list(opts.share_tp),
        }


def run_sglang_bench(opts: SGLangBenchOptions, log: Callable[[str], None] = print) -> list[Figure]:
    from hicache_ray.integrations.sglang.backend import HiCacheRayStorage  # needs sglang

    started = ensure_ray()
    store = f"bench-sglang-{os.getpid()}"
    pool = _HostPool(opts)
    backend = HiCacheRayStorage(_Config(opts, store))
    backend.register_mem_pool_host(pool)
    raw = RawRay(RayStorageOptions().object_bytes)  # the store's default object size
    try:
        return _figures(opts, backend, pool, raw, log)
    finally:
        backend.close()
        raw.clear()
        from actors.stores import drop_store

        drop_store(store)
        if started:
            import ray

            ray.shutdown()


class _RawPlaced:
    """The ceiling: the raw Ray object store moving the same objects between their places
    in the host pool and the store. A put gathers each object out of the pool into one
    reused staging buffer (``ray.put`` takes contiguous bytes) and puts them grouped into
    objects of the store's size; a get fetches objects another process put and copies each
    into its place in the pool. No keys, index, checksum or verification."""

    def __init__(self, raw: RawRay, shapes: list[tuple[int, ...]]) -> None:
        self.raw = raw
        self.staging = [torch.empty(shape, dtype=torch.bfloat16) for shape in shapes]
        self.payloads = [byte_view(t) for t in self.staging]

    def put(self, names: list[str], views: list[torch.Tensor]) -> None:
        for buf, view in zip(self.staging, views, strict=True):
            buf.view(view.shape).copy_(view)
        self.raw.write(names, self.payloads)

    def stage(self, names: list[str]) -> None:
        self.raw.stage(names, self.payloads)

    def get(self, names: list[str], views: list[torch.Tensor]) -> None:
        for payload, view in zip(self.raw.fetch(names), views, strict=True):
            place = view.view(torch.int16).numpy()  # bfloat16 has no numpy dtype
            np.copyto(place, payload.view(np.int16).reshape(place.shape))


def _figures(
    opts: SGLangBenchOptions,
    backend: Any,
    pool: _HostPool,
    raw: RawRay,
    log: Callable[[str], None],
) -> list[Figure]:
    n, p = opts.batch_pages, opts.page_size
    plan = backend.plan
    page_bytes: int = sum(o.num_bytes for o in plan.objects)
    nbytes = n * page_bytes
    slots_in, slots_out = torch.arange(n * p), torch.arange(n * p, 2 * n * p)
    views_in = backend._views(range(n), lambda i: (pool.kv_buffer, i))
    views_out = backend._views(range(n), lambda i: (pool.kv_buffer, n + i))
    placed = _RawPlaced(raw, [o.shape for _ in range(n) for o in plan.objects])
    gen = torch.Generator().manual_seed(0)
    elems = page_bytes // 2  # bfloat16
    flats = [torch.randn(elems, generator=gen).to(torch.bfloat16) for _ in range(n)]
    targets = [torch.zeros(elems, dtype=torch.bfloat16) for _ in range(n)]
    warm_object_store(8 * nbytes)
    log(
        f"storage sglang: {opts.repeats} x {n} pages of {page_bytes / 2**20:.2f} MiB "
        f"({len(plan.objects)} objects each), host layout {opts.layout}"
    )
    samples: dict[str, list[float]] = {
        k: [] for k in ("raw_put", "raw_get", "set_v1", "get_v1", "set", "get")
    }
    for rep in range(opts.repeats + 1):  # repeat 0 warms up
        rec = samples if rep else {k: [] for k in samples}
        for v1 in (True, False):
            first = (2 * rep + v1) * 10_000_000
            hashes = page_hashes(list(range(first, first + n * p)), p)
            names = [f"{rep}-{v1}-{i}" for i in range(len(views_in))]
            suffix = "_v1" if v1 else ""
            _timed(rec["raw_put"], partial(placed.put, names, views_in))
            _timed(rec["set" + suffix], partial(_store, backend, v1, hashes, slots_in, flats))
            placed.stage(names)
            backend.backend.flush()  # the shards own their copies: reads see them
            _timed(rec["raw_get"], partial(placed.get, names, views_out))
            _timed(rec["get" + suffix], partial(_load, backend, v1, hashes, slots_out, targets))
            backend.backend.delete([k for h in hashes for k in plan.keys(h)])
            raw.clear()
        # What was read is what was written (outside the timings).
        same = all(torch.equal(a, b) for a, b in zip(views_in, views_out, strict=True))
        if not same or not all(torch.equal(a, b) for a, b in zip(flats, targets, strict=True)):
            raise RuntimeError("the SGLang backend read back other bytes than it wrote")

    return _rates(samples, nbytes)


def _rates(samples: dict[str, list[float]], nbytes: int) -> list[Figure]:
    def gbps(key: str) -> float:
        return nbytes / statistics.median(samples[key]) / 1e9

    ceiling = {"set": gbps("raw_put"), "get": gbps("raw_get")}
    return [
        figure(
            f"storage.sglang.{op}.gbps",
            gbps(op),
            "GB/s",
            ceiling=ceiling[op.split("_")[0]],
            target=0.7 if op.endswith("_v1") else None,
        )
        for op in ("get_v1", "set_v1", "get", "set")
    ]


def _store(
    backend: Any, v1: bool, hashes: list[str], slots: torch.Tensor, flats: list[torch.Tensor]
) -> None:
    _all(backend.batch_set_v1(hashes, slots) if v1 else [backend.batch_set(hashes, flats)])


def _load(
    backend: Any, v1: bool, hashes: list[str], slots: torch.Tensor, targets: list[torch.Tensor]
) -> None:
    if v1:
        _all(backend.batch_get_v1(hashes, slots))
    else:
        _all([page is not None for page in backend.batch_get(hashes, targets)])


def _timed(samples: list[float], work: Callable[[], None]) -> None:
    start = time.perf_counter()
    work()
    samples.append(time.perf_counter() - start)


def _all(results: list[bool]) -> None:
    """Timed calls are only valid when the whole batch went through."""
    if not all(results):
        raise RuntimeError(
            f"the SGLang backend moved {sum(results)} of {len(results)}; see the log"
        )
