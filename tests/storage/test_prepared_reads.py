"""Reads set up ahead (``prepare_get``) and run later on their leading keys (``get_prepared``),
over every object store: the same pages, checks and counts as ``get``, nothing past the
count touched, a caller's mistake refused before any I/O."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_ray.keys import page_hashes
from hicache_ray.storage import MemoryObjects, NullBackend, PagedBackend, PreparedRead
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


def _rows_stored(
    backend_factory: Any, num: int, stored: int, *, strided: bool
) -> tuple[Any, list[str], list[torch.Tensor], list[torch.Tensor]]:
    """A backend holding every object of the first ``stored`` of ``num`` pages; the keys
    and pages of all, page by page, and one row tensor per object of 6 slots filled with
    3.0 (every other element of a base when ``strided``, as a pool laid out otherwise)."""
    backend = backend_factory()
    plan = backend.plan
    hashes = page_hashes([7_000 + i for i in range(num * 4)], 4)
    keys = [k for h in hashes for k in plan.keys(h)]
    gen = torch.Generator().manual_seed(5)
    pages = [torch.randn(o.shape, generator=gen).half() for _ in hashes for o in plan.objects]
    per = len(plan.objects)
    assert backend.put(keys[: stored * per], pages[: stored * per]) == stored * per
    rows = []
    for o in plan.objects:
        wide = (6, *o.shape[:-1], o.shape[-1] * (2 if strided else 1))
        base = torch.full(wide, 3.0, dtype=torch.float16)
        rows.append(base[..., ::2] if strided else base)
    return backend, keys, pages, rows


@every_store
@pytest.mark.parametrize("strided", [False, True])
def test_a_read_into_rows_lands_each_object_in_its_slot_and_nowhere_else(
    backend_factory, strided: bool
) -> None:
    backend, keys, pages, rows = _rows_stored(backend_factory, 3, 3, strided=strided)
    per, slots = len(rows), [4, 1, 2]
    read = backend.prepare_get_rows(keys, rows, slots)
    assert backend.get_prepared(read, len(keys)) == len(keys)
    for j, slot in enumerate(slots):
        assert all(torch.equal(rows[i][slot], pages[j * per + i]) for i in range(per))
    assert all(bool((r[s] == 3.0).all()) for r in rows for s in (0, 3, 5))
    if strided:  # the elements between the objects' own are not touched
        assert all(bool((r._base[..., 1::2] == 3.0).all()) for r in rows)
    assert backend.stats().get_pages == len(keys)


@every_store
def test_a_read_into_rows_past_a_missing_page_zeroes_only_its_count(backend_factory) -> None:
    backend, keys, _, rows = _rows_stored(backend_factory, 3, 1, strided=True)
    per = len(rows)
    read = backend.prepare_get_rows(keys, rows, [0, 1, 2])
    assert backend.get_prepared(read, 2 * per) == per
    assert all(bool((r[1] == 0).all()) and bool((r[2] == 3.0).all()) for r in rows)


def test_a_wrong_read_into_rows_is_refused_before_any_io() -> None:
    def backend_factory() -> PagedBackend:
        return PagedBackend("memory", MemoryObjects(), make_plan())

    backend, keys, _, rows = _rows_stored(backend_factory, 2, 2, strided=False)
    per = len(rows)
    swapped = [keys[1], keys[0], *keys[2:]] if per > 1 else keys
    wrong_rows = [r.float() for r in rows]
    cases: list[tuple[list[str], list[torch.Tensor], list[Any], str]] = [
        (keys[:-1], rows, [0, 1], "keys for 2 pages"),
        (keys, rows, [0, 6], "outside"),
        (keys, rows, [0, True], "outside"),
        (keys, wrong_rows, [0, 1], "expected"),
        (keys, [r[0] for r in rows], [0, 1], "pages"),
    ]
    if per > 1:
        cases.append((swapped, rows, [0, 1], "is not object 0"))
    for bad_keys, bad_rows, slots, message in cases:
        with pytest.raises(ValueError, match=message):
            backend.prepare_get_rows(bad_keys, bad_rows, slots)
    assert all(bool((r == 3.0).all()) for r in rows)
    assert backend.stats().get_pages == 0 and backend.stats().refused_pages >= 2


def test_the_default_reads_rows_through_get() -> None:
    backend, plan = NullBackend(), make_plan()
    rows = [torch.zeros((2, *o.shape), dtype=torch.float16) for o in plan.objects]
    hashes = page_hashes(list(range(8)), 4)
    keys = [k for h in hashes for k in plan.keys(h)]
    assert backend.get_prepared(backend.prepare_get_rows(keys, rows, [1, 0]), len(keys)) == 0
    with pytest.raises(ValueError, match="outside"):
        backend.prepare_get_rows(keys, rows, [1, 2])
