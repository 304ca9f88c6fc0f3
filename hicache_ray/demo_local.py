"""The single-process demonstration: a multi-turn chat workload through one rank's L1/L2.

The device pool is smaller than the working set, so later rounds find their history partly
on the device and partly on the host; every cached read is checked against the KV written
for those tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache_ray.bench.report import Figure, figure
from hicache_ray.cache import HiCache
from hicache_ray.config import CacheConfig, MemoryConfig
from hicache_ray.layout import ModelKV, Shard, ShardKV
from hicache_ray.synthetic_engine import ReadbackError, serve
from hicache_ray.workload import multi_turn_prompts

__all__ = ["LocalDemoOptions", "run_local_demo"]


@dataclass(frozen=True)
class LocalDemoOptions:
    clients: int = 16
    rounds: int = 5
    system_len: int = 512
    user_len: int = 96
    answer_len: int = 64
    page_size: int = 16
    device_tokens: int = 4096
    hicache_ratio: float = 4.0
    num_layers: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64


def run_local_demo(
    opts: LocalDemoOptions, device: torch.device, log: Callable[[str], None] = print
) -> tuple[list[Figure], bool]:
    kv = ShardKV(
        model=ModelKV(
            num_layers=opts.num_layers,
            num_kv_heads=opts.num_kv_heads,
            head_dim=opts.head_dim,
            dtype="float16",
        ),
        shard=Shard(),
        page_size=opts.page_size,
    )
    config = CacheConfig(
        memory=MemoryConfig(
            page_size=opts.page_size,
            device_tokens=opts.device_tokens,
            hicache_ratio=opts.hicache_ratio,
        )
    )
    cache = HiCache(config, kv, device=device)
    rounds = multi_turn_prompts(
        opts.clients, opts.rounds, opts.system_len, opts.user_len, opts.answer_len
    )
    working = sum(len(p) for p in rounds[-1])
    log(
        f"device pool {cache.device_pool.num_tokens} tokens, host pool "
        f"{cache.host_pool.num_pages * opts.page_size} tokens, last round's working set "
        f"{working} tokens"
    )
    header = f"{'round':>5} {'prompt tok':>10} {'L1 hit':>8} {'L2 hit':>8} {'recomputed':>10} "
    log(header + f"{'MiB loaded':>10} {'MiB written':>11} {'ms':>7}  read-back")
    totals = {"l1": 0, "l2": 0, "recomputed": 0}
    all_ok = True
    for r, prompts in enumerate(rounds):
        before = cache.counters.snapshot()
        l1 = l2 = prompt_tokens = 0
        ok = True
        start = time.perf_counter()
        for tokens in prompts:
            try:
                handle = serve(cache, tokens)
            except ReadbackError:
                ok = False
                continue
            l1 += handle.device_hit_tokens
            l2 += handle.host_hit_tokens
            prompt_tokens += len(tokens)
        cache.flush()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        after = cache.counters
        loaded = (after.bytes_loaded - before.bytes_loaded) / 2**20
        written = (after.bytes_written - before.bytes_written) / 2**20
        recomputed = prompt_tokens - l1 - l2
        totals["l1"] += l1
        totals["l2"] += l2
        totals["recomputed"] += recomputed
        all_ok &= ok
        log(
            f"{r:>5} {prompt_tokens:>10} {l1:>8} {l2:>8} {recomputed:>10} {loaded:>10.1f} "
            f"{written:>11.1f} {elapsed_ms:>7.0f}  {'passed' if ok else 'FAILED'}"
        )
    cache.check_integrity()
    cache.close()
    figures = [
        figure("demo.local.hit_tokens.l1", float(totals["l1"]), "tokens"),
        figure("demo.local.hit_tokens.l2", float(totals["l2"]), "tokens"),
        figure("demo.local.recomputed_tokens", float(totals["recomputed"]), "tokens"),
        figure(
            "demo.local.readback_failures",
            0.0 if all_ok else 1.0,
            "rounds",
            target=0,
            better="lower",
        ),
    ]
    return figures, all_ok
