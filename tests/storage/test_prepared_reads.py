"""Reads set up ahead (``prepare_get``) and run later on their leading keys (``get_prepared``),
over every object store: the same pages, checks and counts as ``get``, nothing past the
count touched, a caller's mistake refused before any I/O."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_ray.storage import NullBackend, PreparedRead
from tests.storage.conftest import BACKENDS, empty_buffers, make_pages, make_plan, page_keys

every_store = pytest.mark.parametrize("object_store_factory", BACKENDS, indirect=True)


def _stored(backend_factory: Any, num: int, stored: int) -> tuple[Any, list[str], Any, Any]:
    """A backend holding the first ``stored`` of ``num`` pages; their keys, the pages, and
    buffers filled with 3.0 for them."""
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, num), make_pages(plan, num)
    assert backend.put(keys[:stored], pages[:stored]) == stored
    return backend, keys, pages, [torch.full_like(b, 3.0) for b in empty_buffers(plan, num)]


@every_store
def test_a_prepared_read_reads_its_leading_keys_and_touches_nothing_past_them(
    backend_factory,
) -> None:
    backend, keys, pages, out = _stored(backend_factory, 5, 5)
    read = backend.prepare_get(keys, out)
    assert backend.get_prepared(read, 3) == 3
    assert all(torch.equal(out[i], pages[i]) for i in range(3))
    assert all(bool((b == 3.0).all()) for b in out[3:])  # not part of this read
    stats = backend.stats()
    assert (stats.get_pages, stats.get_bytes) == (3, 3 * pages[0].numel() * 2)
    assert backend.get_prepared(read, 0) == 0


@every_store
def test_a_prepared_read_past_a_missing_key_stops_there_and_zeroes_its_buffers(
    backend_factory,
) -> None:
    backend, keys, _, out = _stored(backend_factory, 4, 2)
    assert backend.get_prepared(backend.prepare_get(keys, out), 3) == 2
    assert bool((out[2] == 0).all()) and bool((out[3] == 3.0).all())


@every_store
def test_a_wrong_buffer_is_refused_when_prepared_and_a_wrong_count_when_read(
    backend_factory,
) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys = page_keys(plan, 2)
    wrong = torch.empty(plan.objects[0].shape, dtype=torch.float32)
    with pytest.raises(ValueError, match="expected"):
        backend.prepare_get(keys, [empty_buffers(plan, 1)[0], wrong])
    assert backend.stats().refused_pages == 1
    read = backend.prepare_get(keys, empty_buffers(plan, 2))
    for count in (-1, 3):
        with pytest.raises(ValueError, match="outside"):
            backend.get_prepared(read, count)
    with pytest.raises(ValueError, match="not prepared here"):  # another backend's read
        backend.get_prepared(PreparedRead(keys, empty_buffers(plan, 2)), 1)
    assert backend.stats().get_pages == 0


def test_the_default_prepares_nothing_and_reads_through_get() -> None:
    backend, plan = NullBackend(), make_plan()
    read = backend.prepare_get(page_keys(plan, 2), empty_buffers(plan, 2))
    assert backend.get_prepared(read, 2) == 0
    with pytest.raises(ValueError, match="outside"):
        backend.get_prepared(read, 3)
