"""An engine loop without a model: it writes synthetic KV and checks every cached read.

Used by the single-process demo and by the tests. A real engine replaces ``compute`` with
its forward pass; the calls into :class:`~hicache_ray.cache.hicache.HiCache` are the same.
"""

from __future__ import annotations

import torch

from apps.bench.workload import synthetic_kv
from hicache_ray.cache.handle import CacheHandle
from hicache_ray.cache.hicache import HiCache

__all__ = ["ReadbackError", "check_prefix", "compute", "serve"]


class ReadbackError(AssertionError):
    """KV read back from the cache differs from what was written for those tokens."""


def check_prefix(cache: HiCache, handle: CacheHandle, tokens: list[int]) -> None:
    """Wait for loads, then compare the cached prefix's KV with what its tokens should hold."""
    cache.wait_ready(handle, timeout=60)
    n = handle.num_cached_tokens
    if not n:
        return
    kv, first = cache.kv, cache.kv.layer_range[0]
    idx = handle.slot_indices(0, n, cache.page_size)
    for layer in range(kv.num_layers):
        for slot in range(kv.kv_slots):
            got = cache.device_pool.buffers[slot][layer][idx]
            want = synthetic_kv(kv, first + layer, slot, list(range(n)), tokens[:n])
            if not torch.equal(got.cpu(), want):
                raise ReadbackError(f"wrong KV read back for layer {layer}, slot {slot}")


def compute(cache: HiCache, handle: CacheHandle, tokens: list[int]) -> None:
    """Reserve slots for the uncached tokens and write their synthetic KV."""
    start = handle.num_cached_tokens
    cache.reserve(handle, len(tokens) - start)
    idx = handle.slot_indices(start, len(tokens), cache.page_size)
    kv, first = cache.kv, cache.kv.layer_range[0]
    positions = list(range(start, len(tokens)))
    for layer in range(kv.num_layers):
        for slot in range(kv.kv_slots):
            values = synthetic_kv(kv, first + layer, slot, positions, tokens[start:])
            cache.device_pool.buffers[slot][layer][idx] = values.to(cache.device_pool.device)


def serve(cache: HiCache, tokens: list[int]) -> CacheHandle:
    """One whole request: match, check the cached prefix, compute the rest, insert."""
    handle = cache.match(tokens)
    try:
        check_prefix(cache, handle, tokens)
        compute(cache, handle, tokens)
    except BaseException:
        cache.release(handle)
        raise
    cache.finish(handle, tokens)
    return handle
