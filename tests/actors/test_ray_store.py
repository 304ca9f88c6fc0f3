"""The object-store L3 beyond the contract: ownership, grouping, batching, budget, failures."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch

from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.keys import ShardPlan
from hicache_ray.storage import StorageBackend, create_backend
from tests.helpers import ensure_local_ray, plasma_usage, wait_until
from tests.storage.conftest import empty_buffers, make_pages, make_plan, page_keys

ray = pytest.importorskip("ray")
ray_store = pytest.importorskip("actors.ray_store")
page_objects = pytest.importorskip("actors.page_objects")
shards = pytest.importorskip("actors.shards")
stores = pytest.importorskip("actors.stores")
inspect = pytest.importorskip("actors.inspect")

_names = itertools.count()


@pytest.fixture(scope="module")
def _shared() -> Any:
    """A store shared by the tests (its shard actors start once), dropped at the end."""
    ensure_local_ray()
    opts = RayStorageOptions(name="store", num_shards=2)
    yield opts
    stores.drop_store(opts.name)


@pytest.fixture
def options(_shared: Any) -> Any:
    """The shared store, emptied around each test."""
    stores.clear_store(_shared)
    yield _shared
    stores.clear_store(_shared)


def _backend(opts: RayStorageOptions, plan: ShardPlan | None = None) -> StorageBackend:
    config = StorageConfig(backend="ray", model_id="test/model", ray=opts)
    return create_backend(config, plan or make_plan())


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@ray.remote(num_cpus=0)
class _Writer:
    def write(self, opts: RayStorageOptions, num_pages: int) -> int:
        plan = make_plan()
        backend = _backend(opts, plan)
        stored = backend.put(page_keys(plan, num_pages), make_pages(plan, num_pages))
        backend.flush()  # the shards own the pages now: they outlive this process
        return stored


def test_pages_outlive_the_process_that_wrote_them(options) -> None:
    writer = _Writer.remote()
    assert ray.get(writer.write.remote(options, 6)) == 6
    ray.kill(writer)  # its process (and anything it owned) is gone
    plan = make_plan()
    backend = _backend(options, plan)
    keys = page_keys(plan, 6)
    assert backend.exists(keys) == 6
    out = empty_buffers(plan, 6)
    assert backend.get(keys, out) == 6 and _equal(out, make_pages(plan, 6))


def test_pages_of_a_batch_share_objects_of_bounded_size(options) -> None:
    plan = make_plan()
    page = make_pages(plan, 1)[0]
    page_bytes = page.numel() * page.element_size()
    _backend(options, plan).put(page_keys(plan, 16), make_pages(plan, 16))
    stats = stores.store_stats(options)
    assert stats.keys == 16 and stats.objects == 2  # one object per shard
    small = RayStorageOptions(
        name=f"store{next(_names)}", num_shards=2, object_bytes=page_bytes * 3
    )
    try:
        _backend(small, plan).put(page_keys(plan, 16), make_pages(plan, 16))
        stats = stores.store_stats(small)
        assert stats.keys == 16 and 6 <= stats.objects <= 8  # <= 3 pages per object
    finally:
        stores.drop_store(small.name)


def test_a_batch_is_one_call_per_shard(options, monkeypatch) -> None:
    plan = make_plan()
    backend = _backend(options, plan)
    keys = page_keys(plan, 128)
    backend.put(keys[:64], make_pages(plan, 64))
    calls: list[str] = []
    real = ray_store.RayObjects._remote

    def counting(self: Any, shard: int, method: str, *args: Any) -> Any:
        calls.append(method)
        return real(self, shard, method, *args)

    monkeypatch.setattr(ray_store.RayObjects, "_remote", counting)
    reader = _backend(options, plan)  # no metadata cached: the shards are asked
    assert reader.exists(keys) == 64  # a prefetch query: sizes and object references
    assert calls == ["find", "find"]
    calls.clear()
    buffers = empty_buffers(plan, 64)
    assert reader.get(keys[:64], buffers) == 64  # the query's references: no shard asked
    assert calls == []
    assert reader.get(keys[:64], empty_buffers(plan, 64)) == 64  # taken: asked again
    assert calls == ["locate", "locate"]
    for got, page in zip(buffers, make_pages(plan, 64), strict=True):
        assert torch.equal(got, page)


def test_a_recalled_object_lost_is_a_miss_that_keeps_the_key(options, monkeypatch) -> None:
    """A reference a query kept may be a writer's object the shard has adopted since: its
    loss makes the read a miss, and the key stays for the next query to find again."""
    plan = make_plan()
    keys, pages = page_keys(plan, 4), make_pages(plan, 4)
    _backend(options, plan).put(keys, pages)
    reader = _backend(options, plan)  # no metadata cached: the shards are asked
    assert reader.exists(keys) == 4
    monkeypatch.setattr(ray_store.RayObjects, "_fetch", lambda self, refs: {})
    assert reader.get(keys, empty_buffers(plan, 4)) == 0
    monkeypatch.undo()
    fresh = _backend(options, plan)
    assert fresh.exists(keys) == 4
    buffers = empty_buffers(plan, 4)
    assert fresh.get(keys, buffers) == 4
    assert all(torch.equal(b, p) for b, p in zip(buffers, pages, strict=True))


def test_budget_evicts_whole_objects_least_recently_used(options) -> None:
    plan = make_plan()
    page_bytes = make_pages(plan, 1)[0].numel() * 2
    # one shard, room for about two 4-page objects
    opts = RayStorageOptions(
        name=f"store{next(_names)}",
        num_shards=1,
        capacity_bytes=9 * (page_bytes + 200),
        metadata_ttl_s=0.0,  # ask the shard every time: it evicts on its own
    )
    try:
        backend = _backend(opts, plan)
        batches = [page_keys(plan, 4, seed=s) for s in range(3)]
        assert backend.put(batches[0], make_pages(plan, 4, seed=0)) == 4
        assert backend.put(batches[1], make_pages(plan, 4, seed=1)) == 4
        assert backend.get(batches[0], empty_buffers(plan, 4)) == 4  # batch 0 most recent
        assert backend.put(batches[2], make_pages(plan, 4, seed=2)) == 4  # evicts batch 1
        assert [backend.exists(b) for b in batches] == [4, 0, 4]
        stats = stores.store_stats(opts)
        assert stats.evicted_objects == 1 and stats.bytes <= opts.capacity_bytes
        too_big = make_pages(plan, 12, seed=3)
        assert backend.put(page_keys(plan, 12, seed=3), too_big) == 0
        assert backend.stats().put_failures == 1  # the batch ends at its first failure
    finally:
        stores.drop_store(opts.name)


def test_by_default_a_store_keeps_a_share_of_the_object_store(options, caplog) -> None:
    """capacity_bytes 0 takes capacity_fraction (0.5 by default) of the cluster's object
    store: a fill past it evicts instead of growing until Ray spills. A tiny fraction
    here, so the fill stays small; 0 and 0 is unlimited, and says so."""
    assert RayStorageOptions().capacity_fraction == 0.5
    memory = ray.cluster_resources()["object_store_memory"]
    assert shards.shard_capacity(RayStorageOptions(), 2) == int(0.5 * memory) // 2
    plan = make_plan()
    page_bytes = make_pages(plan, 1)[0].numel() * 2
    fraction = 20 * page_bytes / memory  # room for about 20 pages in all
    opts = RayStorageOptions(name=f"store{next(_names)}", num_shards=2, capacity_fraction=fraction)
    try:
        backend = _backend(opts, plan)
        for seed in range(12):  # 48 pages: more than twice the budget
            backend.put(page_keys(plan, 4, seed=seed), make_pages(plan, 4, seed=seed))
        backend.flush()
        stats = stores.store_stats(opts)
        assert stats.capacity_bytes == 2 * (int(fraction * memory) // 2)
        assert 0 < stats.bytes <= stats.capacity_bytes and stats.evicted_objects > 0
        assert inspect.object_store_summary()["spilled_mib"] == 0
    finally:
        stores.drop_store(opts.name)
    with caplog.at_level("WARNING", logger="actors.ray_store"):
        assert shards.shard_capacity(RayStorageOptions(capacity_fraction=0.0), 2) == 0
    assert "no byte limit" in caplog.text


def test_a_tenant_over_its_quota_loses_its_own_oldest_pages(options) -> None:
    """Quotas are per owner: an owner past its quota loses its least recently used
    objects, others keep theirs; a put larger than the quota is refused; a lower quota
    evicts at once, and no quota lets the owner grow again."""
    plan = make_plan()
    page_bytes = make_pages(plan, 1)[0].numel() * 2
    opts = RayStorageOptions(name=f"store{next(_names)}", num_shards=1, metadata_ttl_s=0.0)
    try:
        backend = _backend(opts, plan)
        stores.set_quotas(opts, {"t-a": 9 * (page_bytes + 200)})  # about two 4-page objects
        batches = [page_keys(plan, 4, seed=s) for s in range(5)]
        for seed in range(3):
            assert backend.put(batches[seed], make_pages(plan, 4, seed=seed), owner="t-a") == 4
        assert backend.put(batches[3], make_pages(plan, 4, seed=3), owner="t-b") == 4
        assert backend.put(batches[4], make_pages(plan, 4, seed=4)) == 4
        assert [backend.exists(b) for b in batches] == [0, 4, 4, 4, 4]  # a's oldest went
        owners = stores.store_owners(opts)
        assert owners["t-a"] <= 9 * (page_bytes + 200) and set(owners) == {"t-a", "t-b", ""}
        assert stores.store_stats(opts).quota_evicted_objects == 1
        too_big = page_keys(plan, 12, seed=9)
        assert backend.put(too_big, make_pages(plan, 12, seed=9), owner="t-a") == 0
        stores.set_quotas(opts, {"t-a": 5 * (page_bytes + 200), "t-b": 0})
        assert [backend.exists(b) for b in batches] == [0, 0, 4, 4, 4]
        stores.set_quotas(opts, {})
        assert backend.put(batches[0], make_pages(plan, 4, seed=0), owner="t-a") == 4
        assert [backend.exists(b) for b in batches] == [4, 0, 4, 4, 4]
    finally:
        stores.drop_store(opts.name)


def test_object_store_returns_to_baseline_after_eviction_and_clear(options) -> None:
    baseline = plasma_usage()
    plan = make_plan()
    backend = _backend(options, plan)
    for seed in range(3):
        backend.put(page_keys(plan, 64, seed=seed), make_pages(plan, 64, seed=seed))
    backend.flush()
    # The shards hold the pages in objects of their own (Ray's usage figures lag, and
    # objects of earlier tests may still be draining: they cannot tell this alone).
    stats = stores.store_stats(options)
    assert stats.objects >= 2 and stats.keys == 3 * 64
    stores.clear_store(options)

    def drained() -> bool:
        mib, objects = plasma_usage()
        return mib <= baseline[0] and objects <= baseline[1]

    wait_until(drained, what="the object store to drain")


def test_a_killed_shard_reads_as_misses_then_serves_again(options) -> None:
    plan = make_plan()
    backend = _backend(options, plan)
    keys, pages = page_keys(plan, 8), make_pages(plan, 8)
    assert backend.put(keys, pages) == 8
    for i in range(options.num_shards):
        shard = ray.get_actor(f"hicache-l3-{options.name}-{i}", namespace=shards.NAMESPACE)
        ray.kill(shard, no_restart=False)  # restarts empty: its objects died with it
    # The kill lands soon, not at once; from then on reads are misses, never errors.
    wait_until(lambda: backend.get(keys, empty_buffers(plan, 8)) == 0, what="the kill")
    wait_until(lambda: backend.put(keys, pages) == 8, what="the shards to come back")
    out = empty_buffers(plan, 8)
    assert backend.get(keys, out) == 8 and _equal(out, pages)


def test_a_shard_removed_for_good_is_made_again(options) -> None:
    plan = make_plan()
    backend = _backend(options, plan)
    keys, pages = page_keys(plan, 4), make_pages(plan, 4)
    backend.put(keys, pages)
    for i in range(options.num_shards):
        shard = ray.get_actor(f"hicache-l3-{options.name}-{i}", namespace=shards.NAMESPACE)
        ray.kill(shard, no_restart=True)
    wait_until(lambda: backend.exists(keys) == 0, what="the kill")  # the calls fail: a miss
    assert backend.stats().get_failures >= 1
    wait_until(lambda: backend.put(keys, pages) == 4, what="new shards")  # made again
    assert backend.get(keys, empty_buffers(plan, 4)) == 4


def test_a_lost_object_is_a_miss_and_leaves_the_index(options, monkeypatch) -> None:
    plan = make_plan()
    backend = _backend(options, plan)
    keys, pages = page_keys(plan, 6), make_pages(plan, 6)
    backend.put(keys[:2], pages[:2])  # keys 2.. live in other objects than keys 0 and 1
    backend.put(keys[2:], pages[2:])
    [(_, (refs, _))] = list(ray_store.RayObjects(options)._fan_out([keys[2]], "locate"))
    gone = refs[0].hex()  # the object holding the third key
    real = ray_store.RayObjects._fetch

    def losing(self: Any, refs: list[Any]) -> list[Any]:
        objects = real(self, refs)
        return [None if r.hex() == gone else o for r, o in zip(refs, objects, strict=True)]

    monkeypatch.setattr(ray_store.RayObjects, "_fetch", losing)
    hits = backend.get(keys, empty_buffers(plan, 6))
    monkeypatch.undo()
    assert hits == 2
    assert ray_store.RayObjects(options).size_many([keys[2]]) == [None]  # left the index


def test_a_dead_owners_object_is_left_out(options) -> None:
    @ray.remote(num_cpus=0)
    class Owner:
        def make(self) -> list[Any]:
            return [ray.put(b"x" * 200_000)]

    owner = Owner.remote()
    ref = ray.get(owner.make.remote())[0]
    ray.kill(owner)  # asynchronous: the owner is gone soon, not at once
    store = ray_store.RayObjects(options)
    wait_until(lambda: store._fetch([ref]) == [None], what="the dead owner's object to be a miss")


def test_shard_count_mismatch_is_refused(options) -> None:
    _backend(options)
    with pytest.raises(ConfigError, match="created with 2 shards"):
        _backend(RayStorageOptions(name=options.name, num_shards=3))


def test_without_ray_the_error_says_what_to_do(monkeypatch) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=r"ray.init"):
        ray_store.RayObjects(RayStorageOptions())


def test_shards_an_older_version_made_are_still_queried(monkeypatch) -> None:
    """Detached shards outlive library upgrades: a store whose shards have no ``find``
    (made before it existed) is queried with ``sizes`` and read with ``locate``."""
    from actors.l3_shard import PageShard

    class OldShard(PageShard):
        find = None  # not a method: the actor has none of that name

    ensure_local_ray()
    plan = make_plan()
    opts = RayStorageOptions(name=f"store{next(_names)}", num_shards=1)
    monkeypatch.setattr(shards, "_Shard", ray.remote(OldShard))
    try:
        keys, pages = page_keys(plan, 4), make_pages(plan, 4)
        _backend(opts, plan).put(keys, pages)
        reader = _backend(opts, plan)
        shard = ray.get_actor(shards.shard_name(opts.name, 0), namespace=shards.NAMESPACE)
        assert not hasattr(shard, "find")
        assert reader.exists(keys) == 4
        buffers = empty_buffers(plan, 4)
        assert reader.get(keys, buffers) == 4
        assert _equal(buffers, pages)
    finally:
        stores.drop_store(opts.name)


def test_small_pages_are_copied_in_one_job_large_ones_on_every_copy_thread() -> None:
    page_objects = pytest.importorskip("actors.page_objects")
    split = page_objects.SPLIT_PAGE_BYTES

    def todo(page_bytes: int, n: int) -> list[Any]:
        return [(i, [], 0, memoryview(bytearray(page_bytes))) for i in range(n)]

    small = todo(split - 1, 5)
    assert page_objects.copy_shares(small, 3) == [small]
    large = todo(split, 5)
    assert page_objects.copy_shares(large, 3) == [large[0::3], large[1::3], large[2::3]]
    assert page_objects.copy_shares(large[:2], 3) == [large[:1], large[1:2]]  # none empty
    assert page_objects.copy_shares([], 3) == []


def test_pages_split_over_the_copy_threads_read_back_exact(options, monkeypatch) -> None:
    plan = make_plan()
    keys, pages = page_keys(plan, 24), make_pages(plan, 24)
    _backend(options, plan).put(keys, pages)
    monkeypatch.setattr("actors.page_objects.SPLIT_PAGE_BYTES", 1)  # these pages split
    jobs: list[int] = []
    real = page_objects.copy_items
    threads: set[str] = set()

    def counting(todo: list[Any], *args: Any) -> None:
        jobs.append(len(todo))
        threads.add(threading.current_thread().name)
        real(todo, *args)

    monkeypatch.setattr(page_objects, "copy_items", counting)
    buffers = empty_buffers(plan, 24)
    assert _backend(options, plan).get(keys, buffers) == 24
    assert sum(jobs) == 24 and len(jobs) >= 3  # every shard's pages on three threads
    assert threading.current_thread().name in threads  # the last answer's first job here
    assert _equal(buffers, pages)
