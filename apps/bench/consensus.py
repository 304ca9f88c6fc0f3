"""``bench micro``'s controller figures: consensus cost per step and the L3 -> L1 fetch.

Consensus: ``world`` spawned rank processes (gloo on 127.0.0.1) each run a controller with
``running_requests`` admitted requests in the step vector (their prefetches and the
acknowledgement counters are part of every step), and time steps without new requests
(``consensus.step_us``: no rank has a changed fact, the common case between arrivals and
completions) and steps where some fact changed (``consensus.step_full_us``: the whole vector
is exchanged), each call alternating with a bare gloo all-reduce of one integer on the same
group so machine noise hits both alike. Rank 0 reports the medians of per-call times.

Fetch: a writer rank stores a prompt in the memory backend; a fresh reader (cold L1 and L2)
then takes it end to end (query, agreed length, reads and verification into L2, load into
L1) against a plain ``copy_`` of the same bytes measured in the same run.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from apps.report import Figure, figure, fp16_kv, time_into
from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.cache.controller import (
    Arrival,
    CacheController,
    Consensus,
    GlooConsensus,
    start_rendezvous,
)
from hicache_ray.cache.controller.protocol import Header
from hicache_ray.cache.handle import CacheHandle
from hicache_ray.keys import plan_shard
from hicache_ray.storage import MemoryObjects, PagedBackend

__all__ = ["ConsensusOptions", "consensus_figures", "fetch_figures"]


@dataclass(frozen=True)
class ConsensusOptions:
    worlds: tuple[int, ...] = (2, 4)
    running_requests: int = 8
    steps_per_block: int = 100
    blocks: int = 21
    fetch_pages: int = 64
    fetch_layers: int = 8
    fetch_heads: int = 8
    fetch_repeats: int = 5
    timeout_s: float = 120.0

    @classmethod
    def quick(cls) -> ConsensusOptions:
        return cls(steps_per_block=50, blocks=5, fetch_pages=8, fetch_layers=2, fetch_repeats=2)


def _config(page_size: int, device_pages: int, share_tp: tuple[int, ...] = ()) -> CacheConfig:
    return CacheConfig(
        memory=MemoryConfig(page_size=page_size, device_tokens=device_pages * page_size),
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=StorageConfig(backend="memory", model_id="bench/model", share_tp=share_tp),
    )


def _controller(
    kv: ShardKV, config: CacheConfig, objects: MemoryObjects, consensus: Consensus | None = None
) -> CacheController:
    backend = PagedBackend("memory", objects, plan_shard(kv, config), scan_on_start=False)
    return CacheController(
        config, kv, storage=backend, consensus=consensus, host_budget_bytes=1 << 34
    )


def _rank(rank: int, world: int, ports: Any, out: Any, opts: ConsensusOptions) -> None:
    torch.set_num_threads(1)
    if rank == 0:
        rendezvous = start_rendezvous(world, timeout_s=opts.timeout_s)
        for _ in range(world - 1):
            ports.put(rendezvous.port)
        consensus = GlooConsensus(
            0, world, "127.0.0.1", rendezvous.port, timeout_s=opts.timeout_s, rendezvous=rendezvous
        )
    else:
        port = ports.get(timeout=opts.timeout_s)
        consensus = GlooConsensus(rank, world, "127.0.0.1", port, timeout_s=opts.timeout_s)
    kv = fp16_kv(2, world, 8, 16, Shard(tp_rank=rank, tp_size=world))
    ctl = _controller(kv, _config(16, 64, share_tp=(world,)), MemoryObjects(), consensus)
    arrivals = [Arrival(f"r{i}", list(range(i, i + 64))) for i in range(opts.running_requests)]
    claims = ctl.step(arrivals if rank == 0 else []).admitted
    ctl.settle(timeout=opts.timeout_s)
    ctl.step(pending=claims)  # every request now sits in the vector, its prefetch agreed
    group = consensus.group
    bare_opts = dist.AllreduceOptions()
    bare_opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
    one = torch.zeros(1, dtype=torch.int64)

    # Single calls alternate (a step, then a bare all-reduce) so both sides of each ratio
    # see the same machine; idle steps and steps with changed facts run as separate
    # phases (consecutive idle steps are the common case). Medians of per-call times.
    step_s: list[float] = []
    full_s: list[float] = []
    bare_s: list[float] = []
    clock = time.perf_counter
    for phase, samples in (("idle", step_s), ("full", full_s)):
        for i in range(opts.blocks * opts.steps_per_block + 50):
            if phase == "full":
                ctl.note_failure()  # a changed fact: this step exchanges the whole vector
            start = clock()
            ctl.step(pending=claims)
            end = clock()
            group.allreduce([one], bare_opts).wait()
            bare = clock()
            if phase == "full":
                ctl.step(pending=claims)  # the flag resets (another full step), untimed
            if i >= 50:  # warm-up
                samples.append(end - start)
                bare_s.append(bare - end)
    vector = len(ctl.claims.facts(claims)) + Header.SIZE
    ctl.close()
    consensus.close()
    if rank == 0:
        medians = [statistics.median(x) * 1e6 for x in (step_s, full_s, bare_s)]
        out.put((*medians, vector))


def consensus_figures(opts: ConsensusOptions, log: Callable[[str], None]) -> list[Figure]:
    figures = []
    ctx = mp.get_context("spawn")
    for world in opts.worlds:
        log(f"consensus: {world} ranks, {opts.running_requests} requests in the step vector")
        ports, out = ctx.Queue(), ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, world, ports, out, opts), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            step_us, full_us, bare_us, vector = _result(out, procs, opts.timeout_s * 2)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        # The ceiling is a cost here (lower is better): ratio = step / bare, target 1.3.
        figures.append(
            figure(
                f"consensus.step_us.world{world}",
                step_us,
                "us",
                ceiling=bare_us,
                target=1.3,
                better="lower",
            )
        )
        figures.append(
            figure(
                f"consensus.step_full_us.world{world}",
                full_us,
                "us",
                ceiling=bare_us,
                better="lower",
            )
        )
        log(
            f"consensus: world {world}: idle step {step_us:.0f} us, step with changed facts "
            f"{full_us:.0f} us ({vector} integers), bare all-reduce {bare_us:.0f} us"
        )
    return figures


def _result(out: Any, procs: list[Any], timeout_s: float) -> Any:
    """Rank 0's report; fails fast (with exit codes) when a rank process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            if any(code not in (None, 0) for code in codes):
                raise RuntimeError(f"a rank process died (exit codes {codes})") from None
    raise RuntimeError(f"ranks did not report within {timeout_s:.0f}s")


def fetch_figures(
    opts: ConsensusOptions, device: torch.device, log: Callable[[str], None]
) -> list[Figure]:
    kv = fp16_kv(opts.fetch_layers, opts.fetch_heads, 128, 64)
    n = opts.fetch_pages
    nbytes = n * kv.page_bytes
    log(f"fetch: {n} pages ({nbytes / 2**20:.0f} MiB) L3 -> L2 -> L1, cold pools each time")
    config = _config(64, n + 1)
    objects = MemoryObjects()
    tokens = list(range(n * 64 + 1))
    writer = _controller(kv, config, objects)
    handle = _take(writer, Arrival("w", tokens))
    writer.reserve(handle, len(tokens))
    for per_layer in writer.cache.device_pool.buffers:
        for buf in per_layer:
            buf.normal_()
    writer.finish(handle, tokens)
    while True:
        writer.settle()
        if not writer.step().busy:
            break
    writer.close()
    src = torch.full((nbytes,), 3, dtype=torch.uint8, device=device)
    dst = torch.ones_like(src)
    fetch_s: list[float] = []
    copy_s: list[float] = []
    for rep in range(opts.fetch_repeats + 1):
        reader = _controller(kv, config, objects)
        samples = (fetch_s, copy_s) if rep else ([], [])
        time_into(lambda r=reader: _fetch(r, tokens, n), samples[0])  # type: ignore[misc]
        time_into(lambda: dst.copy_(src), samples[1])
        reader.close()
        del reader
        gc.collect()  # the reader's pools (in reference cycles) are freed now, not mid-fetch
    gbps = nbytes / statistics.median(fetch_s) / 1e9
    ceiling = nbytes / statistics.median(copy_s) / 1e9
    return [figure("fetch.l3_to_l1.gbps", gbps, "GB/s", ceiling=ceiling, target=0.6)]


def _take(ctl: CacheController, arrival: Arrival) -> CacheHandle:
    """Admit ``arrival``, step until it may run, and take its cached prefix."""
    result = ctl.step([arrival])
    claim = result.admitted[0]
    while claim not in result.runnable:
        ctl.settle()
        result = ctl.step(pending=[claim])
    return ctl.take(claim)


def _fetch(ctl: CacheController, tokens: list[int], num_pages: int) -> None:
    handle = _take(ctl, Arrival("r", tokens))
    ctl.wait_ready(handle)
    if handle.num_cached_tokens != num_pages * ctl.config.page_size:
        raise RuntimeError(f"fetched {handle.num_cached_tokens} tokens, not {num_pages} pages")
    ctl.release(handle)
