"""A running request's prompt goes into the tree when its prefill is done
(:meth:`HiCache.cache_prompt`), not only when it finishes."""

from __future__ import annotations

from apps.bench.synthetic_engine import check_prefix, compute, serve
from hicache_ray.base.tokens import encode_tokens
from hicache_ray.cache.hicache import HiCache
from tests.core.test_cache import make_cache

PROMPT = list(range(1, 19))  # 4 whole pages of 4 tokens, and 2 tokens more


def _running(cache: HiCache, tokens: list[int]):  # type: ignore[no-untyped-def]
    h = cache.match(tokens)
    compute(cache, h, tokens)
    return h


def test_a_request_hits_the_prompt_of_one_still_running() -> None:
    cache = make_cache(device_tokens=64)
    first = _running(cache, PROMPT)
    assert cache.cache_prompt(first, encode_tokens(PROMPT)) == 4
    assert cache.counters.prompt_pages_cached == 4
    cache.check_integrity()
    cache.flush()
    assert cache.counters.written_pages == 0  # the write policy waits for the request's end
    second = cache.match([*PROMPT[:16], 99, 98])
    assert second.device_hit_tokens == 16
    assert second.device_pages[:4] == first.device_pages[:4]  # the running request's pages
    check_prefix(cache, second, [*PROMPT[:16], 99, 98])
    compute(cache, second, [*PROMPT[:16], 99, 98])
    cache.finish(second, [*PROMPT[:16], 99, 98])
    cache.finish(first, PROMPT)  # its prompt is in the tree already: no duplicate
    cache.check_integrity()
    cache.flush()
    assert cache.counters.written_pages == 4  # the shared pages, once, at the first one's end
    assert serve(cache, [*PROMPT, 50, 51, 52]).device_hit_tokens == 16
    cache.check_integrity()
    cache.close()


def test_a_released_request_leaves_its_prompt_in_the_tree() -> None:
    cache = make_cache(device_tokens=64)
    first = _running(cache, PROMPT)
    cache.cache_prompt(first, encode_tokens(PROMPT))
    cache.release(first)  # aborted while decoding: the prompt's KV is still right
    cache.check_integrity()
    cache.flush()
    assert cache.counters.written_pages == 4  # written to L2 like a finished request's
    again = cache.match(PROMPT)
    assert again.device_hit_tokens == 16
    check_prefix(cache, again, PROMPT)
    cache.release(again)
    cache.check_integrity()
    cache.close()


def test_another_copy_in_the_tree_skips_it_and_finish_frees_the_duplicates() -> None:
    cache = make_cache(device_tokens=64)
    first, second = _running(cache, PROMPT), _running(cache, PROMPT)  # both missed
    assert cache.cache_prompt(first, encode_tokens(PROMPT)) == 4
    assert cache.cache_prompt(second, encode_tokens(PROMPT)) == 0  # first's pages hold it
    assert cache.cache_prompt(first, encode_tokens(PROMPT)) == 0  # in the tree already
    cache.check_integrity()
    used = cache.device_pool.allocator.num_used_pages
    cache.finish(second, PROMPT)
    assert cache.device_pool.allocator.num_used_pages == used - 5  # 4 duplicates + a part page
    cache.finish(first, PROMPT)
    cache.check_integrity()
    cache.close()
