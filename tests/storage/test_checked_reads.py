"""Reads verified on the store's copy threads (``ObjectStore.read_many``'s ``check``): a page
the store checked is not verified again, one it did not check still is, and one that fails
its check is a corrupt page like any other; a fault injector never passes the check on."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from hicache_ray.base.storage_config import Fault
from hicache_ray.base.views import byte_view
from hicache_ray.storage import FaultyObjects, MemoryObjects, PagedBackend
from hicache_ray.storage.objects import PageCheck, ReadOutcome
from hicache_ray.storage.page_format import (
    CorruptPage,
    ReadOut,
    checksum_of,
    encode_header,
    verify,
)
from tests.storage.conftest import empty_buffers, make_pages, make_plan, page_keys


class _Checking(MemoryObjects):
    """A memory store that reads as a parallel one does: it calls ``check`` for the pages
    in ``checked`` (every page when None) right after reading each."""

    reads_in_parallel = True

    def __init__(self, checked: set[int] | None = None) -> None:
        super().__init__()
        self.checked = checked
        self.checks = 0

    def read_many(
        self, keys: Sequence[str], outs: Sequence[ReadOut], check: PageCheck | None = None
    ) -> list[ReadOutcome]:
        found = super().read_many(keys, outs)
        for i, outcome in enumerate(found):
            if check is None or not isinstance(outcome, tuple):
                continue
            if self.checked is None or i in self.checked:
                self.checks += 1
                try:
                    check(i, outcome[0], outcome[1] or checksum_of(outs[i]))
                except CorruptPage as exc:
                    found[i] = exc
        return found


@pytest.fixture
def verifies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys ``verify`` ran for, in order (the store's checks included)."""
    seen: list[str] = []

    def counted(header: bytes, key: str, *rest: object) -> None:
        seen.append(key)
        verify(header, key, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr("hicache_ray.storage.paged.verify", counted)
    return seen


@pytest.mark.parametrize("checked", [None, {0, 2}])
def test_each_page_is_verified_once_where_the_store_checked_it_or_after(
    verifies: list[str], checked: set[int] | None
) -> None:
    plan = make_plan()
    objects = _Checking(checked)
    backend = PagedBackend("memory", objects, plan, scan_on_start=False)
    keys, pages = page_keys(plan, 4), make_pages(plan, 4)
    assert backend.put(keys, pages) == 4
    out = empty_buffers(plan, 4)
    assert backend.get(keys, out) == 4
    assert all(torch.equal(a, b) for a, b in zip(out, pages, strict=True))
    assert sorted(verifies) == sorted(keys)  # once each, by the store or the backend
    assert objects.checks == (4 if checked is None else 2)


def test_a_page_that_fails_the_stores_check_is_corrupt_deleted_and_zeroed() -> None:
    plan = make_plan()
    objects = _Checking()
    backend = PagedBackend("memory", objects, plan, scan_on_start=False)
    keys, pages = page_keys(plan, 3), make_pages(plan, 3)
    assert backend.put(keys, pages) == 3
    # the second key's object holds the third page (a header naming another key)
    header = encode_header(keys[2], plan.digest, pages[2], byte_view(pages[2]))
    objects.remove_many([keys[1]])
    assert objects.write_many([keys[1]], [header], [byte_view(pages[2])]) == [None]
    out = empty_buffers(plan, 3)
    assert backend.get(keys, out) == 1
    assert torch.equal(out[0], pages[0]) and not out[1].any() and not out[2].any()
    assert backend.stats().corrupt_pages == 1
    assert objects.size_many([keys[1]]) == [None]  # deleted


def test_a_fault_injector_never_hands_the_check_to_the_store_it_damages() -> None:
    plan = make_plan()
    inner = _Checking()
    objects = FaultyObjects(inner, (Fault(op="read", kind="corrupt"),))
    assert objects.reads_in_parallel is False  # a backend over it verifies every page
    backend = PagedBackend("memory", objects, plan, scan_on_start=False)
    keys, pages = page_keys(plan, 2), make_pages(plan, 2)
    assert backend.put(keys, pages) == 2
    # the injector flips a byte after the inner read: had that read been checked, the
    # flipped page would have passed as verified
    outs: list[ReadOut] = [byte_view(b) for b in empty_buffers(plan, 2)]
    found = objects.read_many(keys, outs, lambda *page: None)
    assert len(found) == 2 and inner.checks == 0
    assert backend.get(keys, empty_buffers(plan, 2)) == 0
    assert backend.stats().corrupt_pages == 1
