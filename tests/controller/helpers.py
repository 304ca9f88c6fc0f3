"""Drive a controller like a scheduler would, with KV whose value names its page.

The KV of page ``p`` of a prompt is filled from the page's chained hash (so it depends on
the whole prefix, as real KV does) and this rank's TP/PP coordinates, so a page read back
from any tier, on any rank, can be checked to be exactly the right one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig, WriteConfig
from hicache_ray.base.layout import ShardKV
from hicache_ray.base.storage_config import Fault, MemoryStorageOptions, StorageConfig
from hicache_ray.cache.controller import Arrival, CacheController, Consensus
from hicache_ray.cache.controller.fetch_task import FetchTask
from hicache_ray.cache.handle import CacheHandle
from hicache_ray.keys import page_hashes, plan_shard
from hicache_ray.storage import FaultyObjects, ObjectStore, PagedBackend
from tests.conftest import make_kv
from tests.controller.driven import Driven

PAGE = 4


def controller_config(
    *,
    device_tokens: int = 128,
    hicache_ratio: float = 2.0,
    write_policy: str = "write_through",
    prefetch_policy: str = "wait_complete",
    threshold_tokens: int = 0,
    max_host_fraction: float = 0.5,
    backend: str = "memory",
    faults: tuple[Fault, ...] = (),
    batch_size_pages: int = 4,
    share_tp: tuple[int, ...] = (),
    share_pp: tuple[int, ...] = (),
    mem_layout: str = "page_first",
    eager_reads: bool = True,
) -> CacheConfig:
    return CacheConfig(
        memory=MemoryConfig(
            page_size=PAGE,
            device_tokens=device_tokens,
            hicache_ratio=hicache_ratio,
            mem_layout=mem_layout,  # type: ignore[arg-type]
            io_backend="direct" if mem_layout == "page_first_direct" else "kernel",
            layer_granule=2 if mem_layout == "page_first_direct" else 0,
        ),
        write=WriteConfig(policy=write_policy),  # type: ignore[arg-type]
        prefetch=PrefetchConfig(
            policy=prefetch_policy,  # type: ignore[arg-type]
            threshold_tokens=threshold_tokens,
            max_host_fraction=max_host_fraction,
            timeout_base_s=1.0,
            timeout_per_1k_tokens_s=0.0,
            eager_reads=eager_reads,
        ),
        storage=StorageConfig(
            backend=backend,
            model_id="test/model",
            batch_size_pages=batch_size_pages,
            share_tp=share_tp,
            share_pp=share_pp,
            memory=MemoryStorageOptions(),
            faults=faults,
        ),
    )


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(num_tokens)]


def page_value(tokens: list[int], page: int) -> float:
    digest = page_hashes(tokens[: (page + 1) * PAGE], PAGE)[-1]
    return float(int(digest[:5], 16))


def _page_kv(
    ctl: CacheController | Driven, handle: CacheHandle, tokens: list[int], page: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(device slot tensor view, expected value) per slot and layer of one page."""
    pool = ctl.cache.device_pool
    shard = ctl.cache.kv.shard
    slots = slice(handle.device_pages[page] * PAGE, (handle.device_pages[page] + 1) * PAGE)
    base = page_value(tokens, page)
    for s, per_layer in enumerate(pool.buffers):
        for layer, buf in enumerate(per_layer):
            heads = torch.arange(buf.shape[1], dtype=buf.dtype).view(1, -1, 1)
            heads = heads + shard.tp_rank * buf.shape[1]
            value = base + 0.5 * s + 0.25 * (layer + 8 * shard.pp_rank) + heads / 64
            yield buf[slots], value.expand(PAGE, -1, buf.shape[2])


def fill_pages(
    ctl: CacheController | Driven, handle: CacheHandle, tokens: list[int], first: int
) -> None:
    """Write the KV of pages ``[first, len(handle.device_pages))`` (the engine's forward)."""
    for p in range(first, min(len(handle.device_pages), len(tokens) // PAGE)):
        for view, value in _page_kv(ctl, handle, tokens, p):
            view.copy_(value)


def check_pages(
    ctl: CacheController | Driven, handle: CacheHandle, tokens: list[int], num_pages: int
) -> None:
    """Assert the first ``num_pages`` device pages of ``handle`` hold this prompt's KV."""
    for p in range(num_pages):
        for i, (view, value) in enumerate(_page_kv(ctl, handle, tokens, p)):
            assert torch.equal(view, value), f"page {p}: slot/layer {i} holds other KV"


def run_request(
    ctl: Driven, rid: str, tokens: list[int], *, settle: bool = True
) -> tuple[int, CacheHandle]:
    """Admit (rank 0 passes the arrival), step until runnable, take, check, compute, finish.

    ``settle`` waits for local background work between steps; without it the loop just
    steps (a deadline-driven policy then sees the reads still running). Returns the agreed
    cached pages and the finished handle.
    """
    arrivals = [Arrival(rid, tokens)] if ctl.consensus.rank == 0 else []
    result = ctl.step(arrivals)
    while rid not in result.runnable:
        if settle:
            ctl.settle(timeout=30)
        result = ctl.step()
    handle = ctl.take(rid)
    ctl.wait_ready(handle, timeout=30)
    cached = handle.num_cached_tokens // PAGE
    check_pages(ctl, handle, tokens, cached)
    ctl.reserve(handle, len(tokens) - handle.num_cached_tokens)
    fill_pages(ctl, handle, tokens, cached)
    ctl.finish(handle, tokens)
    return cached, handle


def make_controller(
    config: CacheConfig,
    kv: ShardKV,
    objects: ObjectStore,
    *,
    faults: tuple[Fault, ...] = (),
    consensus: Consensus | None = None,
    clock: Callable[[], float] | None = None,
) -> Driven:
    """A controller over ``objects`` (shared L3), with ``faults`` injected under verification,
    driven by request id (:class:`Driven`)."""
    plan = plan_shard(kv, config)
    store = FaultyObjects(objects, faults, seed=1) if faults else objects
    backend = PagedBackend("memory", store, plan, scan_on_start=False)
    ctl = CacheController(
        config,
        kv,
        storage=backend,
        consensus=consensus,
        host_budget_bytes=1 << 30,
        clock=clock or time.monotonic,
    )
    return Driven(ctl)


def drain(ctl: Driven) -> None:
    """Step until no rank has background work left (collective: every rank calls it)."""
    while True:
        ctl.settle(timeout=30)
        if not ctl.step().busy:
            return


def stored(objects: ObjectStore, tokens: list[int], **config: object) -> None:
    """Run ``tokens`` through a writer rank (the tests' usual KV) and back its pages up into
    ``objects``."""
    kv = make_kv(page_size=PAGE)
    writer = make_controller(controller_config(**config), kv, objects)  # type: ignore[arg-type]
    run_request(writer, "writer", tokens)
    drain(writer)
    writer.check_integrity()
    writer.close()


def gate_queries(reader: Driven) -> threading.Event:
    """Hold every L3 query of ``reader`` until the returned event is set (so it answers
    after the admitting step, whatever the machine's speed)."""
    assert reader.prefetch is not None
    worker = reader.prefetch.query
    leading, gate = worker._leading, threading.Event()

    def gated(task: FetchTask, end: int) -> int:
        assert gate.wait(30)
        return leading(task, end)

    worker._leading = gated  # type: ignore[method-assign]
    return gate
