"""The recompute guard: an L3 lookup or read never keeps a request waiting longer than
computing its tokens would, as the rank measures both (``prefetch.recompute_guard``)."""

from __future__ import annotations

import msgspec
import pytest

from hicache_ray.base.storage_config import Fault
from hicache_ray.cache.controller import Arrival, CacheController
from hicache_ray.cache.controller.cost import CostModel
from hicache_ray.cache.handle import CacheHandle
from hicache_ray.storage import MemoryObjects
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    check_pages,
    controller_config,
    drain,
    make_controller,
    prompt,
    stored,
)
from tests.helpers import FakeClock

KV = make_kv(page_size=PAGE)


def test_the_cost_model_weighs_reads_against_compute() -> None:
    cost = CostModel()
    assert cost.worth_reading(10, 40) and cost.wait_s(40, 2.0) == 2.0  # nothing measured
    cost.note_forward(8, 1.0)  # a decode step says nothing about prefill
    assert cost.s_per_token == 0.0
    cost.note_forward(100, 0.1)
    assert cost.s_per_token == pytest.approx(0.001)
    assert cost.wait_s(1000, 2.0) == pytest.approx(1.0)  # computing 1,000 tokens: 1 s
    assert cost.wait_s(100_000, 2.0) == 2.0  # never past the configured deadline
    assert cost.wait_s(1, 2.0) == pytest.approx(0.01)  # never cut sooner than 10 ms
    assert cost.worth_reading(10, 40)  # reads unmeasured yet
    cost.note_read(10, 0.1)  # 10 ms a page
    assert not cost.worth_reading(10, 40)  # 100 ms of reads against 40 ms of compute
    assert cost.worth_reading(1, 40)
    cost.note_read(10, 0.0001)  # the moving average follows, weighted
    assert cost.s_per_page == pytest.approx(0.75 * 0.01 + 0.25 * 0.00001)


def test_the_cost_model_weighs_lookups_against_compute() -> None:
    cost = CostModel()
    assert cost.worth_querying(1, 16)  # nothing measured: look up any page
    cost.note_forward(100, 0.1)  # 1 ms a token
    assert cost.worth_querying(1, 16)  # lookups unmeasured yet
    cost.note_query(0.0)  # says nothing
    assert cost.s_per_query == 0.0
    cost.note_query(0.01)  # 10 ms from admission to the answer
    assert cost.worth_querying(1, 16)  # 16 ms of compute against 10 ms
    assert not cost.worth_querying(1, 8)  # 8 ms of compute: computing is sooner
    cost.note_read(1, 0.01)  # and 10 ms a page read
    assert not cost.worth_querying(1, 16)  # 16 ms against 10 + 10 ms
    assert cost.worth_querying(2, 64)  # 64 ms against 10 + 20 ms


@pytest.mark.parametrize("guard", [True, False])
def test_a_lookup_slower_than_compute_is_skipped(guard: bool) -> None:
    objects = MemoryObjects()
    tokens = prompt(5, 40)
    stored(objects, tokens)
    reader = _reader(objects, guard, FakeClock())
    reader.claims.cost.note_forward(1000, 0.001)  # 1 us a token: 40 us for this prompt
    reader.claims.cost.note_query(1.0)  # a lookup answers in 1 s
    reader.step([Arrival("r", tokens)])
    assert (reader.known["r"].task is None) == guard  # no lookup at all
    handle = _taken(reader, "r")
    assert handle.num_cached_tokens == (0 if guard else 40)
    assert reader.stats().prefetch_queries_skipped == int(guard)
    if not guard:  # the lookup that ran was measured (moving average, from 1 s)
        assert reader.claims.cost.s_per_query < 1.0
    _close(reader, handle)


def _taken(reader: CacheController, rid: str) -> CacheHandle:
    """Step until ``rid`` may run, take its prefix and wait until it is loaded."""
    while rid not in reader.step().runnable:
        pass
    handle = reader.take(rid)
    reader.wait_ready(handle, timeout=30)
    return handle


def _close(reader: CacheController, handle: CacheHandle) -> None:
    """Release ``handle``, let the background work end, check the pools, close."""
    reader.release(handle)
    drain(reader)
    reader.check_integrity()
    reader.close()


def _reader(objects: MemoryObjects, guard: bool, clock: FakeClock) -> CacheController:
    config = controller_config(prefetch_policy="timeout")
    prefetch = msgspec.structs.replace(config.prefetch, recompute_guard=guard)
    return make_controller(
        msgspec.structs.replace(config, prefetch=prefetch), KV, objects, clock=clock
    )


@pytest.mark.parametrize("guard", [True, False])
def test_a_read_slower_than_compute_is_skipped(guard: bool) -> None:
    objects = MemoryObjects()
    tokens = prompt(3, 40)
    stored(objects, tokens)
    reader = _reader(objects, guard, FakeClock())
    reader.claims.cost.note_forward(1000, 0.001)  # 1 us a token
    reader.claims.cost.note_read(1, 1.0)  # 1 s a page
    reader.step([Arrival("r", tokens)])
    task = reader.known["r"].task
    assert task is not None and task.queried.wait(30)
    handle = _taken(reader, "r")
    read = handle.num_cached_tokens // PAGE
    assert read == (0 if guard else 10)
    check_pages(reader, handle, tokens, read)
    skipped = reader.stats().unfulfilled_tokens["slower_than_compute"]
    assert skipped == (40 if guard else 0)
    _close(reader, handle)


def test_a_read_is_cut_when_computing_would_have_finished() -> None:
    objects = MemoryObjects()
    tokens = prompt(4, 40)
    stored(objects, tokens)
    clock = FakeClock()
    slow = Fault(op="read", kind="delay", delay_s=0.05)
    config = controller_config(prefetch_policy="timeout")
    reader = make_controller(config, KV, objects, faults=(slow,), clock=clock)
    reader.claims.cost.note_forward(100, 0.1)  # 1 ms a token: 40 ms for this prompt
    reader.step([Arrival("r", tokens)])
    task = reader.known["r"].task
    assert task is not None and task.queried.wait(30)
    result = reader.step()  # the reads start
    assert task.read_started and "r" not in result.runnable
    clock.now = 0.045  # past the 40 ms of compute, long before the 1 s deadline
    assert reader.step().runnable == ["r"]
    handle = reader.take("r")
    reader.wait_ready(handle, timeout=30)
    cached = handle.num_cached_tokens // PAGE
    assert cached < 10
    check_pages(reader, handle, tokens, cached)
    assert reader.claims.cost.s_per_page > 0  # the cut read was measured as it was
    _close(reader, handle)
