"""The tree evicts like SGLang's own RadixCache (0.5.23): on the same trace and capacity,
every request matches the same number of pages (strict LRU over leaves, splits stamping
both halves)."""

from __future__ import annotations

from array import array

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from apps.bench.tree_sglang import NullAllocator
from tests.tree.test_lru_reference import _TRACES, PAGE, _replay


def _sglang(trace: list[list[int]], capacity: int) -> list[int]:
    cache = RadixCache.create_simulated(mock_allocator=NullAllocator(), page_size=PAGE)
    out = []
    for tokens in trace:
        whole = tokens[: len(tokens) - len(tokens) % PAGE]
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", whole))))
        out.append(m.device_prefix_len // PAGE)
        cache.inc_lock_ref(m.last_device_node)
        held = (cache.evictable_size() + cache.protected_size()) // PAGE
        need = len(whole) // PAGE - m.device_prefix_len // PAGE
        if capacity - held < need:
            cache.evict(EvictParams(num_tokens=(need - (capacity - held)) * PAGE))
        held = (cache.evictable_size() + cache.protected_size()) // PAGE
        if capacity - held >= need:
            value = torch.arange(len(whole), dtype=torch.int64)
            cache.insert(InsertParams(key=RadixKey(array("q", whole)), value=value))
        cache.dec_lock_ref(m.last_device_node)
    return out


@settings(max_examples=100, deadline=None)
@given(trace=_TRACES, capacity=st.integers(7, 24))
def test_matched_lengths_equal_sglang_radix_cache(trace: list[list[int]], capacity: int) -> None:
    ours, _ = _replay(trace, capacity)
    assert ours == _sglang(trace, capacity)
