"""``bench runtime`` on the real path: an L3 hit on a fresh deployment over the ray store,
timed at the caller, beside bare Ray reads of the same objects.

A TP=1 deployment computes a prefix and stores it (the unified keys: every TP size reads
the same objects). Then, for each TP size and repetition, a fresh deployment of that size
serves the prefix plus new tokens (every page from L3) and then the prefix plus other new
tokens (every page from L1): ``runtime.l3_hit.ttft_vs_l1.tp{N}`` is the difference of the
medians of the two TTFTs at the caller (``RequestResult.caller_ttft_s``). The ceiling of
the L3 hit's wait (``query_s + agreement_s + prefetch_s`` of its split: admitted to
started) is what the same shards take to hand the same objects to as many readers at once
with bare Ray calls: fresh actors (as the deployment's ranks are fresh) calling ``locate``
on every shard, ``ray.get`` of the references and one copy of each payload into a host
buffer, no checksum, no slack (``runtime.l3_hit.wait_vs_store.tp{N}``, medians).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import ray
import xxhash

from actors.deployment import Deployment
from actors.ray_store import RayObjects
from actors.stores import drop_store
from apps.bench.runtime_guard import guard_figures
from apps.bench.workload import random_tokens
from apps.experiments import shared_storage
from apps.report import Figure, figure, hit_credit, split_figures
from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.base.storage_config import RayStorageOptions
from hicache_ray.base.tokens import encode_tokens
from hicache_ray.engine.model import ModelConfig
from hicache_ray.engine.request import GenerateRequest, RequestResult
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.keys import page_hashes, plan_shard

__all__ = ["l3_hit_figures"]


@ray.remote(num_cpus=1)
class _BareReader:
    """Reads one rank's objects of a prefix with bare Ray calls (the ceiling)."""

    def __init__(self, options: RayStorageOptions, keys: list[str]) -> None:
        self._store = RayObjects(options)
        n = self._store.num_shards
        self._by_shard: dict[int, list[str]] = {}
        for key in keys:
            self._by_shard.setdefault(xxhash.xxh64_intdigest(key.encode()) % n, []).append(key)
        self._keys = len(keys)

    def ready(self) -> bool:
        return True

    def read(self) -> tuple[float, int]:
        """Seconds to locate, fetch and copy every payload once, and the bytes copied."""
        started = time.perf_counter()
        calls = [
            self._store.shard_handle(s).locate.remote(keys) for s, keys in self._by_shard.items()
        ]
        payloads = []
        for refs, places in ray.get(calls):
            objects = ray.get(refs)
            payloads += [objects[o][item + 1] for o, item in (p for p in places if p)]
        size = sum(memoryview(p).nbytes for p in payloads)
        out, at = np.empty(size, dtype=np.uint8), 0
        for p in payloads:
            view = np.frombuffer(p, dtype=np.uint8)
            out[at : at + view.size] = view
            at += view.size
        return time.perf_counter() - started, size


def _bare_read_s(model: ModelConfig, cache: CacheConfig, tp: int, prefix: list[int]) -> float:
    """Median over 5 of the slowest of ``tp`` bare readers reading at once, each a fresh
    actor reading for the first time (as a fresh deployment's ranks do: the first access
    maps the store's memory into the process). Of 3, the median was itself an outlier
    now and then (93 ms against 23-24 in the runs beside it), which flattered the ratio."""
    hashes = page_hashes(encode_tokens(prefix), cache.page_size)
    keys = []
    for rank in range(tp):
        shard = Shard(tp_rank=rank, tp_size=tp)
        kv = ShardKV(model=model.model_kv(), shard=shard, page_size=cache.page_size)
        plan = plan_shard(kv, cache)
        keys.append([k for h in hashes for k in plan.keys(h)])
    times = []
    for _ in range(5):
        readers = [_BareReader.remote(cache.storage.ray, ks) for ks in keys]  # type: ignore[attr-defined]
        ray.get([r.ready.remote() for r in readers])  # started, not timed
        times.append(max(t for t, _ in ray.get([r.read.remote() for r in readers])))
        for r in readers:
            ray.kill(r)
    return float(statistics.median(times))


def _hits(
    config: DeploymentConfig, prefix: list[int], i: int
) -> tuple[RequestResult, float, float]:
    """A fresh deployment: an L3 hit, then an L1 hit, then a prompt as long that nothing
    holds (the caller TTFTs of the last two)."""
    vocab = config.model.vocab_size
    dep = Deployment.launch(config)
    new = len(prefix) + 16
    try:
        dep.generate([GenerateRequest("warm", random_tokens(vocab, 32, 900 + i), 1)])
        l3 = dep.generate([GenerateRequest("l3", prefix + random_tokens(vocab, 16, i), 1)])[0]
        dep.wait_idle(timeout_s=120)
        l1 = dep.generate([GenerateRequest("l1", prefix + random_tokens(vocab, 16, 50 + i), 1)])
        miss = dep.generate([GenerateRequest("miss", random_tokens(vocab, new, 7000 + i), 1)])
    finally:
        dep.shutdown()
    for r in (l3, l1[0], miss[0]):
        if r.error is not None:
            raise RuntimeError(f"bench request failed: {r.error}")
    if l3.storage_hit_tokens < len(prefix) - 16:
        raise RuntimeError(f"the L3 hit found {l3.storage_hit_tokens} of {len(prefix)} tokens")
    return l3, l1[0].caller_ttft_s, miss[0].caller_ttft_s


def l3_hit_figures(
    model: ModelConfig,
    tp_sizes: tuple[int, ...],
    length: int,
    repeats: int,
    log: Callable[[str], None],
) -> list[Figure]:
    """The figures of each TP size (none when ``tp_sizes`` is empty)."""
    from apps.experiments import embedded_ray

    if not tp_sizes:
        return []
    store = f"bench-l3hit-{os.getpid()}"
    storage = shared_storage(f"reference/{model.name}", RayStorageOptions(name=store))
    cache = CacheConfig(
        memory=MemoryConfig(page_size=16, device_tokens=2 * (length + 64)), storage=storage
    )
    prefix = random_tokens(model.vocab_size, length, length)
    found: list[Figure] = []
    with embedded_ray(max(tp_sizes) + 1):
        try:
            _store_prefix(model, cache, prefix)
            for tp in tp_sizes:
                found += _tp_figures(model, cache, tp, prefix, repeats, log)
            found += guard_figures(model, cache, min(length, 1024), _store_prefix, log)
        finally:
            drop_store(store)
    return found


def _store_prefix(model: ModelConfig, cache: CacheConfig, prefix: list[int]) -> None:
    config = DeploymentConfig(name=f"bench-l3w-{os.getpid()}", model=model, cache=cache)
    dep = Deployment.launch(config)
    try:
        dep.generate([GenerateRequest("write", [*prefix, 1], 1)])
        dep.wait_idle(timeout_s=300)
        ray.get([r.flush_storage.remote() for r in dep.ranks])
    finally:
        dep.shutdown()


def _tp_figures(
    model: ModelConfig,
    cache: CacheConfig,
    tp: int,
    prefix: list[int],
    repeats: int,
    log: Callable[[str], None],
) -> list[Figure]:
    runs: list[tuple[RequestResult, float, float]] = []
    for i in range(repeats):
        name = f"bench-l3r-tp{tp}-{i}-{os.getpid()}"
        config = DeploymentConfig(name=name, model=model, cache=cache, tp_size=tp)
        runs.append(_hits(config, prefix, i))
    bare = _bare_read_s(model, cache, tp, prefix) * 1e3
    splits = [r.ttft_split for r, _, _ in runs]
    wait = statistics.median((s.query_s + s.agreement_s + s.prefetch_s) * 1e3 for s in splits)
    l3 = statistics.median(r.caller_ttft_s * 1e3 for r, _, _ in runs)
    l1 = statistics.median(t * 1e3 for _, t, _ in runs)
    miss = statistics.median(t * 1e3 for _, _, t in runs)
    credit = hit_credit(l3, l1, miss)
    log(
        f"runtime: TP={tp} L3 hit {l3:.0f} ms at the caller (wait {wait:.0f} ms; bare Ray "
        f"reads {bare:.0f} ms), L1 hit {l1:.0f} ms, recompute {miss:.0f} ms: the L3 hit "
        f"saves {credit:.2f} of what an L1 hit saves"
    )
    return [
        figure(f"runtime.miss.caller_ttft_ms.tp{tp}", miss, "ms", better="lower"),
        figure(f"runtime.l3_hit.credit.tp{tp}", credit, "x"),
        *split_figures(f"runtime.l3_hit.tp{tp}", splits),
        figure(f"runtime.l3_hit.ttft_ms.tp{tp}", l3, "ms", better="lower"),
        figure(f"runtime.l1_hit.caller_ttft_ms.tp{tp}", l1, "ms", better="lower"),
        figure(
            f"runtime.l3_hit.wait_vs_store.tp{tp}",
            wait,
            "ms",
            ceiling=bare,
            target=1.5 if tp == 2 else None,
            better="lower",
        ),
        figure(
            f"runtime.l3_hit.ttft_vs_l1.tp{tp}",
            l3 - l1,
            "ms",
            target=60.0 if tp == 2 else None,
            better="lower",
        ),
    ]
