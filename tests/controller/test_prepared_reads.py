"""An eager task's first read batch is set up (slot views, the backend's checks) while its
lookup waits for the store, and its read then uses that set-up for the pages the lookup
found; reads in lanes or through staging buffers set up their own."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import torch

from hicache_ray.base.config import CacheConfig
from hicache_ray.cache.controller import Arrival
from hicache_ray.cache.controller.fetch_task import FetchTask
from hicache_ray.storage import MemoryObjects, PreparedRead, StorageBackend
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    controller_config,
    drain,
    gate_queries,
    make_controller,
    prompt,
    stored,
)

KV = make_kv(page_size=PAGE)


def _one_lane(**kwargs: Any) -> CacheConfig:
    """A config whose reads go in one lane (``read_threads=1``), batches of 4 pages."""
    config = controller_config(**kwargs)
    storage = msgspec.structs.replace(config.storage, read_threads=1)
    return msgspec.structs.replace(config, storage=storage)


class _Calls:
    """Counts the backend's ``prepare_get``, ``prepare_get_rows`` (both in ``prepared``) and
    ``get_prepared`` calls (and their sizes)."""

    def __init__(self, backend: StorageBackend) -> None:
        self.prepared: list[int] = []
        self.rows: list[int] = []  # the calls of prepare_get_rows (indices into prepared)
        self.read: list[int] = []
        prepare, prepare_rows = backend.prepare_get, backend.prepare_get_rows
        read = backend.get_prepared

        def prepare_get(keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> PreparedRead:
            self.prepared.append(len(keys))
            return prepare(keys, buffers)

        def prepare_get_rows(
            keys: Sequence[str], rows: Sequence[torch.Tensor], slots: Sequence[int]
        ) -> PreparedRead:
            self.rows.append(len(self.prepared))
            self.prepared.append(len(keys))
            return prepare_rows(keys, rows, slots)

        def get_prepared(prepared: PreparedRead, count: int) -> int:
            self.read.append(count)
            return read(prepared, count)

        backend.prepare_get = prepare_get  # type: ignore[method-assign]
        backend.prepare_get_rows = prepare_get_rows  # type: ignore[method-assign]
        backend.get_prepared = get_prepared  # type: ignore[method-assign]


def _stored(seed: int, stored_tokens: int = 40) -> tuple[MemoryObjects, list[int]]:
    """A store holding the first ``stored_tokens`` of a 40-token prompt, and the prompt."""
    objects, tokens = MemoryObjects(), prompt(seed, 40)
    stored(objects, tokens[:stored_tokens])
    return objects, tokens


def _end(reader: Any) -> None:
    reader.cancel("r")
    drain(reader)
    reader.check_integrity()
    reader.close()


def _admit(tokens: list[int], config: CacheConfig, objects: MemoryObjects) -> tuple[Any, Any]:
    """A reader admitting ``tokens`` whose lookup is held (until ``gate`` is set) once the
    query thread has asked for its read to be set up."""
    reader = make_controller(config, KV, objects)
    assert reader.storage is not None and reader.prefetch is not None
    calls = _Calls(reader.storage)
    query = reader.prefetch.query
    prepare, asked = query.prepare_read, threading.Event()

    def prepare_read(task: FetchTask) -> None:
        prepare(task)
        asked.set()

    query.prepare_read = prepare_read  # type: ignore[method-assign]
    gate = gate_queries(reader)
    reader.step([Arrival("r", [*tokens, 1])])
    task = reader.known["r"].task
    assert isinstance(task, FetchTask) and task.eager and asked.wait(30)
    return reader, (calls, gate, task)


def test_the_first_batch_is_set_up_before_the_lookup_answers_and_read_from_it() -> None:
    objects, tokens = _stored(51)
    reader, (calls, gate, task) = _admit(tokens, _one_lane(), objects)
    per_page = len(reader.plan.objects)
    assert task.prepared is not None  # asked for before the (held) lookup
    task.prepared.result(timeout=30)
    assert calls.prepared == [4 * per_page] and not task.queried.is_set()
    assert calls.rows == [0]  # into the slots' rows of the pool
    gate.set()
    assert task.read_finished.wait(30) and task.failure is None
    assert task.pages_read == 10
    # the first batch read from its set-up; the other two set up their own (in get)
    assert calls.read[0] == 4 * per_page and calls.prepared[1:] == [4 * per_page, 2 * per_page]
    _end(reader)


def test_a_lookup_that_finds_less_reads_only_what_it_found() -> None:
    objects, tokens = _stored(52, stored_tokens=13)  # 3 whole pages in L3, 10 wanted
    reader, (calls, gate, task) = _admit(tokens, _one_lane(), objects)
    per_page = len(reader.plan.objects)
    gate.set()
    assert task.read_finished.wait(30) and task.failure is None
    assert task.local_total == task.pages_read == 3
    assert calls.prepared == [4 * per_page] and calls.read == [3 * per_page]
    _end(reader)


@pytest.mark.parametrize("layout", ["lanes", "staged"])
def test_reads_in_lanes_or_through_staging_are_not_set_up_ahead(layout: str) -> None:
    objects, tokens = _stored(53)
    config = controller_config() if layout == "lanes" else _one_lane(mem_layout="page_first_direct")
    reader, (calls, gate, task) = _admit(tokens, config, objects)
    gate.set()
    assert task.read_finished.wait(30) and task.pages_read == 10
    assert task.prepared is None and calls.read == calls.prepared and calls.read
    _end(reader)


def test_a_set_up_that_fails_fails_the_read_not_the_rank() -> None:
    objects, tokens = _stored(54)
    reader = make_controller(_one_lane(), KV, objects)
    assert reader.storage is not None
    broken = threading.Event()

    def prepare_get_rows(
        keys: Sequence[str], rows: Sequence[torch.Tensor], slots: Sequence[int]
    ) -> PreparedRead:
        broken.set()
        raise ValueError("a buffer the plan does not know")

    reader.storage.prepare_get_rows = prepare_get_rows  # type: ignore[method-assign]
    reader.step([Arrival("r", [*tokens, 1])])
    task = reader.known["r"].task
    assert task is not None and task.read_finished.wait(30)
    assert broken.is_set() and task.pages_read == 0 and task.failure is not None
    _end(reader)
