"""``bench micro``: the tree beside SGLang 0.5.23's ``RadixCache`` on the same workload.

Both trees get the same requests in the same run, as a server gives them: each request
first matches its prefix, then inserts its whole prompt (timed: ``insert``); then every
request matches again (timed: ``match``). Both take keys prepared before timing (ours the
encoded bytes the runtime keeps per request, SGLang's the ``RadixKey`` its scheduler
builds) and page-sized values (ours page indices, SGLang's the per-token KV indices its
insert slices). SGLang runs with the simulated allocator of its own tests (nothing to
free). ``tree.vs_sglang.*`` is our throughput over SGLang's.
"""

from __future__ import annotations

import gc
import time
import warnings
from array import array
from collections.abc import Callable
from typing import Any

import torch

from apps.report import Figure, figure
from apps.sglang_cpu import allow_sglang_on_cpu

__all__ = ["NullAllocator", "sglang_tree_figures"]

TARGET = 2.0  # our throughput over SGLang's, insert and match


class NullAllocator:
    """The allocator a simulated RadixCache frees into (nothing to free here)."""

    device = "cpu"

    def free_segment(self, value: Any, start_pos: int = 0) -> None:
        pass

    def free(self, value: Any) -> None:
        pass


def _tokens(key: bytes) -> array[int]:
    ids = array("I")
    ids.frombytes(key)
    return array("q", ids)


def _sglang_run(keys: list[bytes], page_size: int) -> tuple[float, float]:
    """Seconds for the inserts and for the matches of ``keys`` in SGLang's RadixCache."""
    with warnings.catch_warnings():  # its CUDA-only quantization modules warn on import
        warnings.simplefilter("ignore", UserWarning)
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    cache = RadixCache.create_simulated(mock_allocator=NullAllocator(), page_size=page_size)
    ids = [_tokens(k) for k in keys]
    values = [torch.arange(i * len(t), (i + 1) * len(t)) for i, t in enumerate(ids)]
    gc.collect()
    insert_s = 0.0
    for tokens, value in zip(ids, values, strict=True):
        cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        params = InsertParams(key=RadixKey(tokens), value=value)
        start = time.perf_counter()
        cache.insert(params)
        insert_s += time.perf_counter() - start
    matches = [MatchPrefixParams(key=RadixKey(t)) for t in ids]
    start = time.perf_counter()
    for params in matches:
        cache.match_prefix(params)
    return insert_s, time.perf_counter() - start


def sglang_tree_figures(
    keys: list[bytes], page_size: int, ours: list[Figure], log: Callable[[str], None]
) -> list[Figure]:
    """SGLang's insert and match rates on ``keys``, and ours over them (``ours``: the
    ``tree.*_per_s`` figures of the same keys)."""
    try:
        allow_sglang_on_cpu()
        insert_s, match_s = _sglang_run(keys, page_size)
    except ImportError as exc:
        log(f"tree: SGLang's RadixCache is not importable ({exc}); no comparison")
        return []
    n = len(keys)
    rate = {f.name: f.value for f in ours}
    theirs = {"insert": n / insert_s, "match": n / match_s}
    log(f"tree: SGLang RadixCache insert {theirs['insert']:.0f}/s, match {theirs['match']:.0f}/s")
    out = [figure(f"tree.sglang.{op}_per_s", theirs[op], "1/s") for op in ("insert", "match")]
    for op in ("insert", "match"):
        speedup = rate[f"tree.{op}_per_s"] / theirs[op]
        out.append(figure(f"tree.vs_sglang.{op}", speedup, "x", target=TARGET))
    return out
