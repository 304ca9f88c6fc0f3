from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_ray.base.errors import AllocatorError
from hicache_ray.cache.memory import PageAllocator


def test_allocates_lowest_ids_and_merges_frees_lazily() -> None:
    a = PageAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    a.free([1, 0])
    assert a.num_free_pages == 7 and a.num_used_pages == 1
    assert a.allocate(5) == [3, 4, 5, 6, 7]  # served from the free list, frees still queued
    assert a.allocate(2) == [0, 1]  # merged and sorted on demand
    assert a.allocate(1) is None and a.allocate(0) == []
    a.check_integrity()


def test_double_free_and_foreign_page_raise_and_leave_state_intact() -> None:
    a = PageAllocator(4)
    pages = a.allocate(2)
    assert pages is not None
    a.free([pages[0]])
    with pytest.raises(AllocatorError, match="freed but not in use"):
        a.free([pages[1], pages[0]])
    a.check_integrity()
    assert a.num_used_pages == 1
    with pytest.raises(AllocatorError):
        a.free([99])


def test_corrupt_free_list_is_caught_as_double_alloc() -> None:
    a = PageAllocator(4)
    a.allocate(1)
    a._free.append(0)  # simulate corruption: page 0 is in use
    with pytest.raises(AllocatorError, match="handed out twice"):
        a.allocate(1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_random_alloc_free_keeps_accounting(ops: list[tuple[bool, int]]) -> None:
    a = PageAllocator(16)
    held: list[int] = []
    for do_alloc, n in ops:
        if do_alloc:
            got = a.allocate(n)
            if got is None:
                assert n > a.num_free_pages
            else:
                assert len(got) == n and not set(got) & set(held)
                held += got
        else:
            a.free(held[:n])
            del held[:n]
        a.check_integrity()
        assert a.num_used_pages == len(held)


class _Fence:
    def __init__(self) -> None:
        self.settled = False


def test_fenced_pages_are_not_reused_until_the_fence_settles() -> None:
    a = PageAllocator(4)
    pages = a.allocate(4)
    assert pages is not None
    fence = _Fence()
    a.free(pages[:2], fence=fence)
    assert a.num_free_pages == 0 and a.num_fenced_pages == 2 and a.num_used_pages == 2
    assert a.allocate(1) is None
    with pytest.raises(AllocatorError):
        a.free([pages[0]])  # already freed: a double free is still caught
    a.check_integrity()
    fence.settled = True
    assert a.num_fenced_pages == 0 and a.allocate(2) == pages[:2]
    a.free(pages[2:], fence=fence)  # a settled fence frees at once
    assert a.num_free_pages == 2
    a.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), max_size=60))
def test_random_fenced_frees_keep_accounting(ops: list[tuple[int, int]]) -> None:
    a = PageAllocator(16)
    held: list[int] = []
    fences: list[_Fence] = []
    fenced: dict[int, list[int]] = {}
    for op, n in ops:
        if op == 0:
            got = a.allocate(n)
            if got is not None:
                assert not set(got) & set(held) and not set(got) & {
                    p for f in fenced.values() for p in f
                }
                held += got
        elif op == 1:
            fence = _Fence()
            fences.append(fence)
            fenced[id(fence)] = held[:n]
            a.free(held[:n], fence=fence)
            del held[:n]
        elif op == 2 and fences:
            fence = fences.pop(0)
            fence.settled = True
            fenced.pop(id(fence))
        else:
            a.free(held[:n])
            del held[:n]
        a.check_integrity()
        assert a.num_used_pages == len(held)
        assert a.num_fenced_pages == sum(len(p) for p in fenced.values())
