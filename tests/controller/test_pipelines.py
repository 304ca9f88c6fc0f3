"""Single-rank pipelines and policies over the memory backend, with injected faults."""

from __future__ import annotations

import pytest

from hicache_ray.base.storage_config import Fault
from hicache_ray.cache.controller import Arrival
from hicache_ray.storage import MemoryObjects
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    check_pages,
    controller_config,
    drain,
    make_controller,
    prompt,
    run_request,
    stored,
)
from tests.helpers import FakeClock

KV = make_kv(page_size=PAGE)


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_pages_come_back_from_l3_exactly(policy: str) -> None:
    objects = MemoryObjects()
    tokens = prompt(1, 40)
    stored(objects, tokens)
    reader = make_controller(controller_config(prefetch_policy=policy), KV, objects)
    cached, _ = run_request(reader, "r", [*tokens, 1, 2, 3])
    stats = reader.stats()
    assert cached == 10 and stats.storage_hit_tokens == 40 and stats.prefetched_pages == 10
    assert stats.cache.host_hit_tokens == 40  # the refill entered L2, then loaded to L1
    # A continuation is backed up under the refilled prefix (which storage already holds).
    run_request(reader, "next", tokens + prompt(9, 8))
    drain(reader)
    reader.check_integrity()
    assert reader.stats().backed_up_pages == 2 and reader.stats().backup_skipped_gap == 0
    reader.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_objects_split_by_head_and_layer_round_trip_through_every_layout(layout: str) -> None:
    # One object per KV head and layer: in most layouts they are not contiguous in the
    # host pool, so reads and backups go through staging copies.
    objects = MemoryObjects()
    tokens = prompt(11, 40)
    config = {"share_tp": (1, KV.model.num_kv_heads), "share_pp": (1, 2), "mem_layout": layout}
    stored(objects, tokens, **config)
    reader = make_controller(controller_config(**config), KV, objects)  # type: ignore[arg-type]
    cached, _ = run_request(reader, "r", tokens)
    assert cached == 10
    reader.close()


def test_best_effort_runs_at_once_and_counts_what_it_gave_up() -> None:
    objects = MemoryObjects()
    tokens = prompt(2, 40)
    stored(objects, tokens)
    slow_reads = (Fault(op="read", kind="delay", delay_s=0.5),)
    config = controller_config(prefetch_policy="best_effort")
    reader = make_controller(config, KV, objects, faults=slow_reads)
    # the query ends at once (agreed in the admitting step), the read takes 0.5 s: the next
    # step runs the request without it
    cached, _ = run_request(reader, "r", tokens, settle=False)
    stats = reader.stats()
    assert cached == 0 and stats.unfulfilled_tokens["terminated"] == 40
    drain(reader)
    reader.check_integrity()
    reader.close()


def test_l1_and_l2_hits_need_no_storage() -> None:
    ctl = make_controller(controller_config(), KV, MemoryObjects())
    tokens = prompt(3, 24)
    run_request(ctl, "a", tokens)
    cached, _ = run_request(ctl, "b", [*tokens, 9])
    assert cached == 6 and ctl.stats().cache.device_hit_tokens == 24
    drain(ctl)
    ctl.check_integrity()
    ctl.close()


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (Fault(op="read", kind="fail", skip=3), 3),
        (Fault(op="read", kind="corrupt", skip=5, limit=1), 5),
        (Fault(op="size", kind="fail", skip=2), 2),
    ],
    ids=["failed-read", "corrupt-page", "failed-query"],
)
def test_storage_faults_shorten_the_prefix_never_the_kv(fault: Fault, expected: int) -> None:
    objects = MemoryObjects()
    tokens = prompt(4, 40)
    stored(objects, tokens)
    reader = make_controller(controller_config(), KV, objects, faults=(fault,))
    cached, _ = run_request(reader, "r", tokens)  # checks the KV of every cached page
    assert cached == expected
    stats = reader.stats()
    if fault.op == "read":
        assert stats.unfulfilled_tokens["read_failed"] == (10 - expected) * PAGE
    if fault.kind == "corrupt":
        assert reader.storage is not None and reader.storage.stats().corrupt_pages == 1
    drain(reader)
    reader.check_integrity()
    reader.close()


def test_timeout_policy_terminates_slow_reads_and_keeps_what_finished() -> None:
    objects = MemoryObjects()
    tokens = prompt(5, 40)
    stored(objects, tokens)
    clock = FakeClock()
    slow = Fault(op="read", kind="delay", delay_s=0.05)
    reader = make_controller(
        controller_config(prefetch_policy="timeout"), KV, objects, faults=(slow,), clock=clock
    )
    reader.step([Arrival("r", tokens)])
    task = reader.known["r"].task
    assert task is not None and task.queried.wait(30)  # the query is quick, the reads slow
    result = reader.step()  # agrees the stored length: the reads start
    assert task.read_started and "r" not in result.runnable  # before the deadline
    clock.now = 10.0
    result = reader.step()
    assert result.runnable == ["r"]
    handle = reader.take("r")
    reader.wait_ready(handle, timeout=30)
    cached = handle.num_cached_tokens // PAGE
    assert cached < 10
    check_pages(reader, handle, tokens, cached)
    assert reader.stats().unfulfilled_tokens["terminated"] == (10 - cached) * PAGE
    reader.release(handle)
    drain(reader)
    reader.check_integrity()
    reader.close()


def test_wait_complete_waits_for_slow_reads() -> None:
    objects = MemoryObjects()
    tokens = prompt(6, 24)
    stored(objects, tokens)
    slow = Fault(op="read", kind="delay", delay_s=0.01)
    reader = make_controller(controller_config(), KV, objects, faults=(slow,))
    cached, _ = run_request(reader, "r", tokens)
    assert cached == 6
    reader.close()


def test_the_end_of_each_query_and_read_is_announced() -> None:
    """A step loop can wait for prefetch progress instead of polling on a timer."""
    import threading

    objects = MemoryObjects()
    tokens = prompt(21, 40)
    stored(objects, tokens)
    reader = make_controller(controller_config(), KV, objects)
    assert reader.prefetch is not None
    calls: list[str] = []
    announced = threading.Event()

    def progress() -> None:
        calls.append(threading.current_thread().name)
        announced.set()

    reader.prefetch.on_progress(progress)
    cached, _ = run_request(reader, "r", [*tokens, 1, 2, 3])
    assert cached == 10 and announced.wait(30)
    assert {"hicache-prefetch-query", "hicache-prefetch-read"} <= set(calls), calls
    reader.close()


def test_a_request_without_an_l3_query_runs_in_the_step_that_admits_it() -> None:
    """No wait for a second agreement (as long as a forward pass under load)."""
    ctl = make_controller(controller_config(), KV, MemoryObjects())
    tokens = prompt(31, 24)
    run_request(ctl, "a", tokens)
    drain(ctl)
    assert ctl.step([Arrival("b", [*tokens, 9])]).runnable == ["b"]  # an L1 hit
    assert ctl.step([Arrival("c", [5, 6, 7])]).runnable == ["b", "c"]  # under one page
    for rid in ("b", "c"):
        ctl.release(ctl.take(rid))
    drain(ctl)
    ctl.check_integrity()
    ctl.close()
