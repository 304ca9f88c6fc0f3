"""Eager L3 reads: host slots reserved at admission, reads started by the query thread the
moment the query answers (no step in between), and every way back to the agreed path."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest

from hicache_ray.cache.controller import Arrival, LocalConsensus
from hicache_ray.cache.controller.fetch_task import FetchTask
from hicache_ray.storage import MemoryObjects
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    controller_config,
    drain,
    gate_queries,
    make_controller,
    prompt,
    run_request,
    stored,
)

KV = make_kv(page_size=PAGE)


def test_the_reads_start_when_the_query_answers_without_a_step() -> None:
    objects = MemoryObjects()
    tokens = prompt(41, 40)
    stored(objects, tokens)
    reader = make_controller(controller_config(), KV, objects)
    gate = gate_queries(reader)
    used = reader.cache.host_pool.allocator.num_used_pages
    reader.step([Arrival("r", [*tokens, 1])])
    task = reader.known["r"].task
    assert task is not None and task.eager and not task.queried.is_set()
    gate.set()
    assert task.read_finished.wait(30)  # no step was taken since the admitting one
    assert task.pages_read == 10 and task.failure is None
    cached, handle = run_request(reader, "r2", [*tokens, 2])  # an L2 hit on the read pages
    assert cached == 10
    reader.cancel("r")
    reader.release(handle)
    drain(reader)
    reader.check_integrity()
    assert reader.stats().host_pages_prefetching == 0
    assert reader.cache.host_pool.allocator.num_used_pages >= used
    reader.close()


def test_off_the_reads_wait_for_the_agreed_count() -> None:
    objects = MemoryObjects()
    tokens = prompt(42, 40)
    stored(objects, tokens)
    reader = make_controller(controller_config(eager_reads=False), KV, objects)
    gate = gate_queries(reader)
    reader.step([Arrival("r", [*tokens, 1])])
    task = reader.known["r"].task
    assert task is not None and not task.eager
    gate.set()
    assert task.queried.wait(30) and not task.read_started
    result = reader.step()
    while "r" not in result.runnable:
        reader.settle(timeout=30)
        result = reader.step()
    assert task.read_started and task.pages_read == 10
    reader.release(reader.take("r"))
    drain(reader)
    reader.check_integrity()
    reader.close()


def test_a_quota_too_small_for_every_page_falls_back_to_the_agreed_read() -> None:
    objects = MemoryObjects()
    tokens = prompt(43, 40)
    stored(objects, tokens)
    # 64 host pages, a tenth of them for prefetches: 6 of the 10 pages, read after agreeing
    reader = make_controller(controller_config(max_host_fraction=0.1), KV, objects)
    cached, handle = run_request(reader, "r", [*tokens, 1])
    assert cached == 6
    assert reader.stats().unfulfilled_tokens["prefetch_quota"] == 4 * PAGE
    reader.release(handle)
    drain(reader)
    reader.check_integrity()
    reader.close()


def test_a_miss_reads_nothing_and_returns_its_slots() -> None:
    reader = make_controller(controller_config(), KV, MemoryObjects())
    free = reader.cache.host_pool.allocator.num_free_pages
    reader.step([Arrival("r", prompt(44, 40))])
    task = reader.known["r"].task
    assert task is not None and task.eager and len(task.host_pages) == 10
    assert task.queried.wait(30) and not task.read_started
    result = reader.step()
    assert "r" in result.runnable
    handle = reader.take("r")
    assert handle.num_cached_tokens == 0 and reader.stats().host_pages_prefetching == 0
    assert reader.cache.host_pool.allocator.num_free_pages == free
    reader.release(handle)
    reader.close()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "agreed"])
def test_cancelled_before_its_query_answers_it_reads_nothing(eager: bool) -> None:
    objects = MemoryObjects()
    tokens = prompt(45, 40)
    stored(objects, tokens)
    reader = make_controller(controller_config(eager_reads=eager), KV, objects)
    gate = gate_queries(reader)
    free = reader.cache.host_pool.allocator.num_free_pages
    reader.step([Arrival("r", [*tokens, 1])])
    task = reader.known["r"].task
    assert task is not None and task.eager is eager
    reader.step(aborts=["r"])  # cancelled (and its slots freed) while the query runs
    assert "r" not in reader.known
    gate.set()
    assert task.queried.wait(30)
    assert not task.read_started and task.pages_read == 0
    drain(reader)
    reader.check_integrity()
    assert reader.cache.host_pool.allocator.num_free_pages == free
    reader.close()


class WaitingConsensus(LocalConsensus):
    """One rank whose next round-1 exchange (a vector of one integer) runs ``during``
    first: as if the rank waited there for its peers meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.during: Callable[[], object] | None = None

    def all_reduce_min(self, values: Sequence[int], step: int) -> list[int]:
        if self.during is not None and len(values) == 1:
            during, self.during = self.during, None
            during()
        return super().all_reduce_min(values, step)


def test_reads_that_end_while_the_rank_waits_in_round_one_are_agreed_in_that_step() -> None:
    """A follower enters a step (and computes its facts) long before the leader's pace
    lets the step's collectives run; its reads ending in between must not wait a step."""
    objects = MemoryObjects()
    tokens = prompt(46, 40)
    stored(objects, tokens)
    consensus = WaitingConsensus()
    reader = make_controller(controller_config(), KV, objects, consensus=consensus)
    assert reader.prefetch is not None
    worker = reader.prefetch.read
    read, gate = worker._read, threading.Event()

    def gated(task: FetchTask) -> None:
        assert gate.wait(30)
        read(task)

    worker._read = gated  # type: ignore[method-assign]
    reader.step([Arrival("r", [*tokens, 1])])
    task = reader.known["r"].task
    assert task is not None and task.queried.wait(30) and task.read_started
    assert reader.step().runnable == []  # reading
    consensus.during = lambda: (gate.set(), task.read_finished.wait(30))
    assert reader.step().runnable == ["r"]
    handle = reader.take("r")
    assert handle.num_cached_tokens == 10 * PAGE
    reader.release(handle)
    drain(reader)
    reader.check_integrity()
    reader.close()
