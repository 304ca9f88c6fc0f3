"""Backup ordering and failures, host capacity, the prefetch quota, refills, cancellation."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest

from hicache_ray.base.errors import HiCacheError
from hicache_ray.base.storage_config import Fault
from hicache_ray.cache.controller import Arrival
from hicache_ray.keys import page_hashes, plan_shard
from hicache_ray.serving.cache_index import CacheIndex, Hits
from hicache_ray.storage import MemoryObjects
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    controller_config,
    drain,
    make_controller,
    prompt,
    run_request,
)
from tests.controller.test_pipelines import stored

KV = make_kv(page_size=PAGE)


def stored_pages(objects: MemoryObjects, tokens: list[int]) -> list[bool]:
    plan = plan_shard(KV, controller_config())
    return [
        all(objects.size_many([k]) != [None] for k in plan.keys(h))
        for h in page_hashes(tokens, PAGE)
    ]


def test_failed_backup_stops_at_the_first_failure_and_leaves_no_holes() -> None:
    objects = MemoryObjects()
    fail = Fault(op="write", kind="fail", skip=4)  # the store stays down after 4 objects
    ctl = make_controller(controller_config(), KV, objects, faults=(fail,))
    tokens = prompt(1, 40)
    run_request(ctl, "a", tokens)
    drain(ctl)
    longer = tokens + prompt(2, 16)
    run_request(ctl, "b", longer)  # a child of the node whose backup failed: tried again
    drain(ctl)
    stats = ctl.stats()
    assert stats.backup_failures == 2 and stats.backed_up_pages == 0
    assert stored_pages(objects, longer) == [True] * 4 + [False] * 10  # a prefix, no holes
    ctl.check_integrity()
    ctl.close()


def test_backups_resume_with_later_writes_once_the_store_is_back() -> None:
    objects = MemoryObjects()
    outage = Fault(op="write", kind="fail", skip=4, limit=1)  # one failed batch, then back
    ctl = make_controller(controller_config(), KV, objects, faults=(outage,))
    tokens = prompt(1, 40)
    run_request(ctl, "a", tokens)
    drain(ctl)
    assert stored_pages(objects, tokens)[4:] == [False] * 6
    longer = tokens + prompt(2, 16)
    run_request(ctl, "b", longer)  # its write retries the failed node first, then its own
    drain(ctl)
    stats = ctl.stats()
    assert stats.backup_failures == 1 and stats.backed_up_pages == 14
    assert stored_pages(objects, longer) == [True] * 14
    ctl.check_integrity()
    ctl.close()


def test_backups_skip_pages_already_stored() -> None:
    objects = MemoryObjects()
    tokens = prompt(3, 24)
    stored(objects, tokens)
    # Below the prefetch threshold: this rank computes the prompt itself, then backs it up.
    ctl = make_controller(controller_config(threshold_tokens=1000), KV, objects)
    cached, _ = run_request(ctl, "a", tokens)
    assert cached == 0
    drain(ctl)
    assert ctl.storage is not None and ctl.storage.stats().put_pages == 0
    assert ctl.stats().backed_up_pages == 6
    ctl.close()


def test_write_back_backs_up_evicted_pages() -> None:
    objects = MemoryObjects()
    config = controller_config(write_policy="write_back", device_tokens=48)  # 12 pages
    ctl = make_controller(config, KV, objects)
    first = prompt(4, 40)
    run_request(ctl, "a", first)
    run_request(ctl, "b", prompt(5, 40))  # evicts (writes back) the first prompt
    drain(ctl)
    assert stored_pages(objects, first) == [True] * 10
    ctl.close()
    reader = make_controller(controller_config(), KV, objects)
    cached, _ = run_request(reader, "r", first)
    assert cached == 10
    reader.close()


def test_prefetch_quota_and_host_capacity_count_the_shortfall() -> None:
    objects = MemoryObjects()
    x, y = prompt(6, 80), prompt(7, 80)  # 20 pages each
    stored(objects, x, device_tokens=128)
    stored(objects, y, device_tokens=128)
    # Device 16 pages, host 32 pages: x takes 20 host slots, y finds only 12.
    ctl = make_controller(controller_config(device_tokens=64, max_host_fraction=1.0), KV, objects)
    ctl.step([Arrival("x", x), Arrival("y", y)])
    ctl.settle(timeout=30)
    ctl.step()  # agrees both stored lengths; reads start
    stats = ctl.stats()
    assert stats.unfulfilled_tokens["host_capacity"] == 8 * PAGE
    assert stats.host_pages_prefetching == 32 and stats.running_prefetches == 2
    ctl.check_integrity()
    ctl.cancel("x")
    ctl.cancel("y")
    ctl.settle(timeout=30)
    ctl.check_integrity()
    assert ctl.stats().host_pages_used == 0
    ctl.close()
    quota = make_controller(
        controller_config(device_tokens=64, max_host_fraction=0.25), KV, objects
    )
    quota.step([Arrival("x", x)])
    quota.settle(timeout=30)
    quota.step()
    assert quota.stats().unfulfilled_tokens["prefetch_quota"] == 12 * PAGE  # 8 of 20 allowed
    quota.close()


def test_refill_under_an_unbacked_node_is_used_but_not_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = MemoryObjects()
    tokens = prompt(8, 40)
    stored(objects, tokens)
    # The 8-token head stays below the threshold (computed here); the full prompt does not.
    ctl = make_controller(controller_config(threshold_tokens=16), KV, objects)
    with monkeypatch.context() as m:
        m.setattr(ctl.cache, "_write", lambda nodes: None)  # host writes skipped
        run_request(ctl, "head", tokens[:8])  # 2 pages on the device, no host copy
    cached, _ = run_request(ctl, "r", tokens)  # pages 2-9 from storage: a refill
    assert cached == 10 and ctl.stats().refills_dropped == 1
    drain(ctl)
    ctl.check_integrity()
    ctl.close()


def test_protocol_misuse_is_refused_clearly() -> None:
    """A claim is taken or cancelled once (requests themselves are checked at the doors:
    the runtime's and the deployment's tests)."""
    ctl = make_controller(controller_config(), KV, MemoryObjects())
    with pytest.raises(HiCacheError, match="not admitted"):
        ctl.take("nope")
    claim = ctl.ctl.step([Arrival("a", [1, 2, 3, 4, 5])]).admitted[0]
    handle = ctl.ctl.take(claim)
    with pytest.raises(HiCacheError, match="already taken or cancelled"):
        ctl.ctl.take(claim)
    with pytest.raises(HiCacheError, match="already taken or cancelled"):
        ctl.ctl.cancel(claim)
    ctl.release(handle)
    ctl.check_integrity()
    snapshot = msgspec.json.decode(msgspec.json.encode(ctl.stats()))
    assert snapshot["requests"] == 1 and "unfulfilled_tokens" in snapshot
    ctl.close()
    ctl.close()


def test_an_arrival_identical_to_the_last_exchange_is_still_admitted() -> None:
    # Found by the state machine: after a cancel, a second arrival of the same size left the
    # step vector unchanged, and the idle path skipped the exchange that admits it.
    ctl = make_controller(controller_config(), KV, MemoryObjects())
    ctl.step([Arrival("q0", [7])])
    ctl.cancel("q0")
    result = ctl.step([Arrival("q1", [7])])
    assert [a.rid for a in result.arrivals] == ["q1"] and list(ctl.known) == ["q1"]
    ctl.close()


def test_write_back_backs_up_a_child_once_its_parent_is_stored() -> None:
    objects = MemoryObjects()
    config = controller_config(write_policy="write_back", device_tokens=128)
    ctl = make_controller(config, KV, objects)
    parent = prompt(12, 40)
    child = parent + prompt(13, 16)
    run_request(ctl, "a", parent)
    run_request(ctl, "b", child)  # a 4-page child node under the 10-page parent
    tree = ctl.cache.tree
    free = ctl.cache.device_pool.allocator.free
    free(tree.evict_device(4, ctl.cache._write_back))  # only the child leaves the device
    drain(ctl)
    assert stored_pages(objects, child) == [False] * 14  # waiting: its parent is not stored
    free(tree.evict_device(10, ctl.cache._write_back))  # now the parent is written back
    drain(ctl)
    assert stored_pages(objects, child) == [True] * 14  # the parent, then the child
    assert ctl.stats().backup_skipped_gap == 1
    ctl.check_integrity()
    ctl.close()


class _GatedObjects(MemoryObjects):
    """A memory store whose writes wait until ``gate`` is set (a slow L3)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def write_many(self, keys: Any, headers: Any, payloads: Any) -> list[Exception | None]:
        assert self.gate.wait(60), "the test never opened the gate"
        return super().write_many(keys, headers, payloads)


@pytest.mark.parametrize(("tokens", "paused"), [(16, True), (48, False)])
def test_backups_behind_by_an_eighth_of_l2_run_beside_the_forward(
    tokens: int, paused: bool
) -> None:
    # L2 holds 64 pages: 4 pages of backlog wait for the forward to end; 12 (over 1/8 of
    # L2, locked until stored) keep running, so hits do not lose L2 to them.
    objects = _GatedObjects()
    ctl = make_controller(controller_config(), KV, objects)
    assert ctl.cache.host_pool.num_pages == 64
    try:
        run_request(ctl, "a", prompt(1, tokens))
        for _ in range(100):  # the host copies are acknowledged, the backups submitted
            ctl.settle(timeout=0)
            ctl.step()
            if ctl.acks.pending_backup_pages:
                break
        assert ctl.acks.pending_backup_pages == tokens // PAGE
        with ctl.computing():
            assert ctl.backup.worker.open.is_set() is not paused
        assert ctl.stats().backup_ran_beside_forward == int(not paused)
    finally:
        objects.gate.set()
    drain(ctl)
    assert stored_pages(objects, prompt(1, tokens)) == [True] * (tokens // PAGE)


@pytest.mark.parametrize("down", [False, True])
def test_the_journal_names_the_pages_every_rank_backed_up(down: bool) -> None:
    objects = MemoryObjects()
    faults = (Fault(op="write", kind="fail", skip=4),) if down else ()  # down after 4 objects
    ctl = make_controller(controller_config(), KV, objects, faults=faults)
    journal = ctl.publish_events()
    tokens = prompt(1, 40)
    run_request(ctl, "a", tokens)
    drain(ctl)
    journal.flush()
    index = CacheIndex()
    batches = journal.since(0) or []
    index.reset("r", batches[0])
    assert all(index.apply("r", batch) for batch in batches[1:])
    hashes = page_hashes(tokens, PAGE)
    backed_up = ctl.stats().backed_up_pages
    assert backed_up == (0 if down else 10)  # a failed batch leaves its pages unnamed
    assert index.hits("r", hashes) == Hits(device=10)
    assert index.hits("other", hashes) == Hits(shared=backed_up)
    index.reset("r", journal.snapshot())  # a snapshot is of the replica's own tiers
    assert index.hits("other", hashes) == Hits(shared=backed_up)
    ctl.close()


class CountingWrites(MemoryObjects):
    """Counts the keys of each write call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[int] = []

    def write_many(self, keys: Any, headers: Any, payloads: Any) -> list[Exception | None]:
        self.writes.append(len(keys))
        return super().write_many(keys, headers, payloads)


@pytest.mark.parametrize(
    ("call_bytes", "pages_per_call"), [(None, [20]), (3, [3] * 6 + [2]), (1, [1] * 20)]
)
def test_a_backup_writes_batch_size_pages_per_call_within_its_byte_cap(
    monkeypatch: pytest.MonkeyPatch, call_bytes: int | None, pages_per_call: list[int]
) -> None:
    """Each store call costs round trips (and, on the ray store, objects every later read
    fetches): a backup writes ``batch_size_pages`` pages per call, at most
    ``BACKUP_CALL_BYTES`` (here in pages of this rank's objects)."""
    from hicache_ray.cache.controller import backup

    writer_bytes = sum(o.num_bytes for o in plan_shard(KV, controller_config()).objects)
    if call_bytes is not None:
        monkeypatch.setattr(backup, "BACKUP_CALL_BYTES", call_bytes * writer_bytes)
    objects = CountingWrites()
    tokens = prompt(31, 20 * PAGE)
    ctl = make_controller(controller_config(batch_size_pages=32), KV, objects)
    run_request(ctl, "r", tokens)
    drain(ctl)
    per_page = len(ctl.plan.objects)
    assert objects.writes == [n * per_page for n in pages_per_call]
    assert all(stored_pages(objects, tokens))
    ctl.check_integrity()
    ctl.close()
