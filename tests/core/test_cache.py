from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from apps.bench.synthetic_engine import check_prefix, compute, serve
from hicache_ray.base.errors import HiCacheError
from hicache_ray.base.tokens import encode_tokens
from hicache_ray.cache.handle import CacheFullError, CacheHandle
from hicache_ray.cache.hicache import HiCache
from hicache_ray.cache.memory import HostPool
from tests.conftest import CPU, make_config, make_kv

POLICIES = ["write_through", "write_through_selective", "write_back"]
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def make_cache(**config: object) -> HiCache:
    kv = make_kv(num_layers=2, num_kv_heads=2, head_dim=4)
    return HiCache(make_config(**config), kv, device=CPU, host_budget_bytes=1 << 30)  # type: ignore[arg-type]


def test_multi_turn_hits_device_then_host() -> None:
    cache = make_cache(device_tokens=16, hicache_ratio=4.0)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    serve(cache, a)
    cache.flush()
    second = serve(cache, [*a, 10, 11, 12])
    assert second.device_hit_tokens == 8
    for i in range(3):  # push a out of the device pool
        serve(cache, [100 + i] * 12)
    cache.flush()
    third = serve(cache, [*a, 10, 11, 12, 13, 14])
    assert third.host_hit_tokens == 12 and third.device_hit_tokens == 0
    cache.flush()
    cache.check_integrity()
    s = cache.counters.snapshot()
    assert s.loaded_pages == 3 and s.host_hit_tokens == 12 and s.bytes_loaded > 0
    cache.close()


def test_selective_writes_only_hot_nodes_and_write_back_writes_on_eviction() -> None:
    sel = make_cache(write_policy="write_through_selective")
    serve(sel, [1] * 8)
    sel.flush()
    assert sel.counters.written_pages == 0
    serve(sel, [1] * 8)  # second hit reaches the threshold (2)
    sel.flush()
    assert sel.counters.written_pages == 2
    sel.close()
    wb = make_cache(write_policy="write_back", device_tokens=8, hicache_ratio=1.0)
    serve(wb, [1] * 8)
    assert wb.counters.written_pages == 0
    serve(wb, [2] * 8)  # evicts [1]*8, writing it back first
    assert wb.counters.written_pages == 2
    h = wb.match([1] * 8)
    assert h.host_hit_tokens == 8
    check_prefix(wb, h, [1] * 8)
    wb.release(h)
    wb.check_integrity()
    wb.close()


def test_request_larger_than_pool_raises_and_leaves_cache_usable() -> None:
    cache = make_cache(device_tokens=8)
    h = cache.match([1] * 20)
    with pytest.raises(CacheFullError, match="more needed"):
        cache.reserve(h, 20)
    cache.release(h)
    cache.check_integrity()
    serve(cache, [3] * 8)
    with pytest.raises(HiCacheError, match="twice"):
        cache.finish(h, [1] * 20)
    cache.close()


def test_finish_refuses_tokens_that_do_not_extend_the_match() -> None:
    cache = make_cache()
    serve(cache, [1] * 8)
    h = cache.match([1] * 8)
    with pytest.raises(ValueError, match="matched prefix"):
        cache.finish(h, [2] * 8)
    cache.release(h)
    cache.check_integrity()
    cache.close()


class _FlakyHost(HostPool):
    fail = False

    def page_rows_bytes(self, layer: int, slot: int) -> np.ndarray:
        if self.fail:
            raise OSError("injected")
        return super().page_rows_bytes(layer, slot)


def _with_flaky_host(cache: HiCache) -> _FlakyHost:
    flaky = _FlakyHost(cache.kv, cache.host_pool.num_pages, "page_first")
    cache.host_pool = flaky
    cache.transfers.close()
    from hicache_ray.cache.memory import TransferEngine

    cache.transfers = TransferEngine(cache.device_pool, flaky)
    return flaky


def test_failed_write_drops_host_copy_and_failed_load_falls_back_to_recompute() -> None:
    cache = make_cache(device_tokens=8)
    flaky = _with_flaky_host(cache)
    flaky.fail = True
    serve(cache, [1] * 8)
    cache.flush()
    assert cache.counters.write_failures == 1 and cache.tree.num_host_pages == 0
    cache.check_integrity()
    flaky.fail = False
    serve(cache, [2] * 8)
    cache.flush()
    serve(cache, [3] * 8)  # evicts [2]*8 from the device; it stays on the host
    cache.flush()
    flaky.fail = True
    h = cache.match([2] * 8)
    assert h.host_hit_tokens == 8
    cache.wait_ready(h)
    assert h.num_cached_tokens == 0 and cache.counters.load_failures == 1
    compute(cache, h, [2] * 8)
    cache.finish(h, [2] * 8)
    flaky.fail = False
    cache.flush()
    cache.check_integrity()
    h = cache.match([2] * 8)
    check_prefix(cache, h, [2] * 8)
    cache.release(h)
    cache.close()


class CacheMachine(RuleBasedStateMachine):
    """Random interleavings of requests, held handles, eviction and polling."""

    policy = "write_through"
    layout = "page_first"

    @initialize()
    def setup(self) -> None:
        ratio = 1.5 if self.policy != "write_back" else 1.0
        self.cache = make_cache(
            device_tokens=24, hicache_ratio=ratio, write_policy=self.policy, mem_layout=self.layout
        )
        self.open: list[tuple[CacheHandle, list[int]]] = []
        self.computed: set[int] = set()  # ids of open handles whose tokens are computed

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()

    prompts = st.lists(st.integers(0, 3), min_size=1, max_size=14)

    @rule(tokens=prompts)
    def request(self, tokens: list[int]) -> None:
        # CacheFullError: every page is held by open handles; their release fixes it
        with contextlib.suppress(CacheFullError):
            serve(self.cache, tokens)

    @rule(tokens=prompts)
    def open_request(self, tokens: list[int]) -> None:
        h = self.cache.match(tokens)
        check_prefix(self.cache, h, tokens)
        self.open.append((h, tokens))

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def cache_prompt(self, data: st.DataObject) -> None:
        """A running request's prompt into the tree before it finishes (its prefill done)."""
        h, tokens = self.open[data.draw(st.integers(0, len(self.open) - 1))]
        if id(h) in self.computed:
            return
        try:
            compute(self.cache, h, tokens)
        except CacheFullError:
            return
        self.computed.add(id(h))
        self.cache.cache_prompt(h, encode_tokens(tokens))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), commit=st.booleans())
    def close_request(self, data: st.DataObject, commit: bool) -> None:
        h, tokens = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        computed = id(h) in self.computed
        self.computed.discard(id(h))
        if commit:
            try:
                if not computed:
                    compute(self.cache, h, tokens)
            except CacheFullError:
                self.cache.release(h)
                return
            self.cache.finish(h, tokens)
        else:
            self.cache.release(h)

    @rule(pages=st.integers(1, 8))
    def evict_device(self, pages: int) -> None:
        hook = self.cache._write_back if self.policy == "write_back" else None
        self.cache.device_pool.allocator.free(self.cache.tree.evict_device(pages, hook))

    @rule(pages=st.integers(1, 8))
    def evict_host(self, pages: int) -> None:
        self.cache.host_pool.allocator.free(self.cache.tree.evict_host(pages))

    @rule()
    def flush(self) -> None:
        self.cache.flush()

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_integrity()


def _machine(policy: str, layout: str) -> type:
    return type(f"Machine_{policy}_{layout}", (CacheMachine,), {"policy": policy, "layout": layout})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_random_interleavings(policy: str, layout: str) -> None:
    machine = _machine(policy, layout)
    machine.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
