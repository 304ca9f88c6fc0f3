"""Error paths of the paged backend, driven by the fault injector on a memory store."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import Fault, FileStorageOptions, StorageConfig
from hicache_ray.storage import (
    FaultyObjects,
    InjectedFault,
    MemoryObjects,
    NullBackend,
    PagedBackend,
    backend_names,
    create_backend,
)
from tests.storage.conftest import empty_buffers, make_pages, make_plan, page_keys, stored_size


def _backend(*faults: Fault, capacity_bytes: int = 0, seed: int = 0):
    objects = FaultyObjects(MemoryObjects(), faults, seed)
    return PagedBackend("memory", objects, make_plan(), capacity_bytes=capacity_bytes), objects


def test_a_write_failure_ends_the_batch_without_holes() -> None:
    backend, objects = _backend(Fault(op="write", kind="fail", skip=2, limit=1))
    plan = backend.plan
    keys = page_keys(plan, 4)
    assert backend.put(keys, make_pages(plan, 4)) == 2
    assert backend.exists(keys) == 2 and stored_size(objects.inner, keys[3]) is None
    assert backend.stats().put_failures == 1
    assert objects.injected == {"write.fail": 1}
    backend.check_integrity()  # the failed page's reservation was given back
    assert backend.put(keys, make_pages(plan, 4)) == 4  # the fault was a one-off


def test_a_failed_write_returns_its_capacity_reservation() -> None:
    backend, _ = _backend(Fault(op="write", kind="fail"), capacity_bytes=1 << 20)
    plan = backend.plan
    assert backend.put(page_keys(plan, 3), make_pages(plan, 3)) == 0
    backend.check_integrity()
    assert backend.stats().stored_bytes == 0


def test_read_failures_and_lookup_failures_are_misses() -> None:
    backend, _objects = _backend(
        Fault(op="read", kind="fail", skip=1), Fault(op="size", kind="fail", skip=3)
    )
    plan = backend.plan
    keys = page_keys(plan, 3)
    assert backend.put(keys, make_pages(plan, 3)) == 3
    assert backend.get(keys, empty_buffers(plan, 3)) == 1
    assert backend.stats().get_failures == 1
    backend.delete(keys)
    assert backend.exists(keys) == 0  # the lookup fails: a miss, not an exception
    assert backend.stats().get_failures == 2
    assert backend.put(keys, make_pages(plan, 3)) == 0  # a failed lookup ends a put too
    assert backend.stats().put_failures == 1


def test_bytes_flipped_on_read_are_caught() -> None:
    backend, objects = _backend(Fault(op="read", kind="corrupt", limit=1))
    plan = backend.plan
    keys = page_keys(plan, 2)
    backend.put(keys, make_pages(plan, 2))
    assert backend.get(keys, empty_buffers(plan, 2)) == 0
    assert backend.stats().corrupt_pages == 1 and stored_size(objects.inner, keys[0]) is None


def test_bytes_flipped_in_a_strided_buffer_are_caught_and_zeroed() -> None:
    backend, _ = _backend(Fault(op="read", kind="corrupt", limit=1))
    plan = backend.plan
    keys = page_keys(plan, 1)
    backend.put(keys, make_pages(plan, 1))
    shape = plan.objects[0].shape
    base = torch.full((*shape[:-1], shape[-1] * 2), 3.0, dtype=torch.float16)
    assert backend.get(keys, [base[..., ::2]]) == 0
    assert backend.stats().corrupt_pages == 1
    assert bool((base[..., ::2] == 0).all()) and bool((base[..., 1::2] == 3.0).all())


def test_bytes_flipped_in_a_read_into_rows_are_caught_and_zeroed() -> None:
    backend, _ = _backend(Fault(op="read", kind="corrupt", limit=1))
    plan = backend.plan
    keys = page_keys(plan, 2)
    backend.put(keys, make_pages(plan, 2))
    shape = plan.objects[0].shape
    base = torch.full((3, *shape[:-1], shape[-1] * 2), 3.0, dtype=torch.float16)
    rows = base[..., ::2]  # the first object's place in 3 slots of a pool laid out otherwise
    assert backend.get_prepared(backend.prepare_get_rows(keys, [rows], [2, 0]), 2) == 0
    assert backend.stats().corrupt_pages == 1
    assert bool((rows[2] == 0).all()) and bool((rows[0] == 0).all())  # both, read ahead
    assert bool((rows[1] == 3.0).all()) and bool((base[..., 1::2] == 3.0).all())


def test_delay_slows_the_call_down() -> None:
    backend, _ = _backend(Fault(op="size", kind="delay", delay_s=0.05))
    start = time.perf_counter()
    assert backend.exists(page_keys(backend.plan, 1)) == 0
    assert time.perf_counter() - start >= 0.05


def test_a_failing_delete_does_not_raise() -> None:
    backend, objects = _backend(Fault(op="remove", kind="fail"))
    keys = page_keys(backend.plan, 1)
    backend.put(keys, make_pages(backend.plan, 1))
    backend.delete(keys)
    assert backend.stats().num_objects == 0 and stored_size(objects.inner, keys[0]) is not None


def test_the_injector_is_reproducible() -> None:
    def hits(seed: int) -> list[int]:
        objects = FaultyObjects(
            MemoryObjects(), (Fault(op="size", kind="fail", probability=0.5),), seed
        )
        return [int(isinstance(objects.size_many(["k"])[0], InjectedFault)) for _ in range(32)]

    assert hits(3) == hits(3) and hits(3) != hits(4) and 0 < sum(hits(3)) < 32
    batch = FaultyObjects(MemoryObjects(), (Fault(op="size", kind="fail", skip=2),))
    answers = batch.size_many(["k"] * 8, leading=False)
    assert answers[:2] == [None, None] and isinstance(answers[2], InjectedFault)
    assert len(answers) == 3  # the batch ends at its first failure


class _Counting(MemoryObjects):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def size_many(self, keys, leading=True):  # type: ignore[no-untyped-def]
        self.calls["size"] = self.calls.get("size", 0) + 1
        return super().size_many(keys, leading)

    def read_many(self, keys, outs):  # type: ignore[no-untyped-def]
        self.calls["read"] = self.calls.get("read", 0) + 1
        return super().read_many(keys, outs)

    def write_many(self, keys, headers, payloads):  # type: ignore[no-untyped-def]
        self.calls["write"] = self.calls.get("write", 0) + 1
        return super().write_many(keys, headers, payloads)


def test_the_injector_keeps_one_store_call_per_batch() -> None:
    inner = _Counting()
    slow = Fault(op="read", kind="delay", delay_s=0.001, probability=0.5)
    backend = PagedBackend("memory", FaultyObjects(inner, (slow,), seed=1), make_plan())
    plan = backend.plan
    keys = page_keys(plan, 16)
    assert backend.put(keys, make_pages(plan, 16)) == 16
    assert backend.exists(keys) == 16 and backend.get(keys, empty_buffers(plan, 16)) == 16
    assert inner.calls == {"size": 1, "write": 1, "read": 1}  # exists was answered from cache


def test_unsupported_faults_are_refused() -> None:
    with pytest.raises(ConfigError, match="truncate on read"):
        Fault(op="read", kind="truncate")
    with pytest.raises(ConfigError, match="probability"):
        Fault(op="read", kind="fail", probability=2.0)


def test_registry_builds_every_builtin_backend(tmp_path) -> None:
    plan = make_plan()
    assert {"none", "memory", "file"} <= set(backend_names())
    assert isinstance(create_backend(StorageConfig(), plan), NullBackend)
    file_config = StorageConfig(
        backend="file", model_id="m", file=FileStorageOptions(root=str(tmp_path))
    )
    with create_backend(file_config, plan) as backend:
        keys = page_keys(plan, 2)
        assert backend.put(keys, make_pages(plan, 2)) == 2 and backend.exists(keys) == 2
    faulty = msgspec.structs.replace(
        file_config, faults=(Fault(op="write", kind="fail"),), backend="memory"
    )
    assert create_backend(faulty, plan).put(page_keys(plan, 1), make_pages(plan, 1)) == 0


def test_an_unbounded_file_store_warns_at_start(tmp_path, caplog) -> None:
    plan = make_plan()
    unbounded = StorageConfig(
        backend="file", model_id="m", file=FileStorageOptions(root=str(tmp_path))
    )
    bounded = msgspec.structs.replace(
        unbounded, file=FileStorageOptions(root=str(tmp_path), capacity_bytes=1 << 20)
    )
    with caplog.at_level("WARNING", logger="hicache_ray.storage.registry"):
        create_backend(bounded, plan).close()
        assert "no byte limit" not in caplog.text
        create_backend(unbounded, plan).close()
    assert f"file L3 at {tmp_path} has no byte limit" in caplog.text


def test_null_backend_stores_nothing() -> None:
    null = NullBackend()
    plan = make_plan()
    assert null.put(page_keys(plan, 1), make_pages(plan, 1)) == 0
    assert null.exists(["a"]) == 0 and null.get([], []) == 0 and null.stats().backend == "none"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"backend": "nope", "model_id": "m"}, "storage_backend"),
        ({"backend": "memory"}, "model_id"),
        ({"backend": "file", "model_id": "m"}, "file.root"),
    ],
)
def test_bad_storage_settings_are_refused(kwargs, field) -> None:
    with pytest.raises(ConfigError) as info:
        create_backend(StorageConfig(**kwargs), make_plan())
    assert info.value.field == field
