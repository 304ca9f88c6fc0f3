"""Round trips to the store: a backup's pages cost one lookup, then one write of the absent
ones (``exists_each`` answers every key and ``put`` trusts it)."""

from __future__ import annotations

from typing import Any

import torch

from hicache_ray.storage import MemoryObjects, PagedBackend
from hicache_ray.storage.base import StorageBackend
from hicache_ray.storage.page_format import LazyHeaders
from tests.storage.conftest import make_pages, make_plan, page_keys


class _Counting:
    """An object store that records which batch calls reach it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, list[str]()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            self.calls.append(name)
            return method(*args, **kw)

        return call


def test_a_backup_asks_once_and_writes_only_what_is_absent() -> None:
    plan = make_plan()
    store = _Counting(MemoryObjects())
    backend = PagedBackend("memory", store, plan, scan_on_start=False)  # type: ignore[arg-type]
    keys, pages = page_keys(plan, 8), make_pages(plan, 8)
    assert backend.put(keys[2:4], pages[2:4]) == 2  # some pages are there already
    store.calls.clear()
    present = backend.exists_each(keys)
    assert present == [False, False, True, True, False, False, False, False]
    todo = [i for i, here in enumerate(present) if not here]
    assert backend.put([keys[i] for i in todo], [pages[i] for i in todo]) == len(todo)
    assert store.calls == ["size_many", "write_many"]
    assert backend.exists(keys) == 8


def test_the_default_answers_from_the_leading_count() -> None:
    class Leading(StorageBackend):
        def exists(self, keys: Any) -> int:
            return 2

        def get(self, keys: Any, buffers: Any) -> int:
            return 0

        def put(self, keys: Any, pages: Any) -> int:
            return 0

        def delete(self, keys: Any) -> None:
            pass

        def stats(self) -> Any:
            return None

    assert Leading().exists_each(["a", "b", "c"]) == [True, True, False]


def test_a_put_of_unseen_pages_does_not_ask() -> None:
    """``unseen``: the caller looked already (the vLLM connector saves pages vLLM computed
    after a miss): one write, no lookup; a page stored meanwhile is written again and kept
    once, and the index counts its bytes once."""
    plan = make_plan()
    store = _Counting(MemoryObjects())
    backend = PagedBackend("memory", store, plan, scan_on_start=False)  # type: ignore[arg-type]
    keys, pages = page_keys(plan, 4), make_pages(plan, 4)
    assert backend.put(keys[:1], pages[:1]) == 1
    before = backend.stats().stored_bytes
    store.calls.clear()
    assert backend.put(keys, pages, unseen=True) == 4
    assert store.calls == ["write_many"]
    assert backend.stats().stored_bytes == 4 * before and backend.stats().num_objects == 4
    out = [torch.empty_like(p) for p in pages]
    assert backend.get(keys, out) == 4
    assert all(torch.equal(a, b) for a, b in zip(out, pages, strict=True))


def test_a_store_that_writes_holding_the_gil_gets_headers_as_it_asks() -> None:
    """``hash_ahead = False`` (the ray store): each header is made when the store first asks
    for it, on the writing thread, and what was written reads back verified."""

    class Writing(MemoryObjects):
        hash_ahead = False

        def write_many(self, keys: Any, headers: Any, payloads: Any) -> Any:
            assert isinstance(headers, LazyHeaders) and headers._made == {}
            return super().write_many(keys, headers, payloads)

    plan = make_plan()
    backend = PagedBackend("memory", Writing(), plan, scan_on_start=False)
    keys, pages = page_keys(plan, 3), make_pages(plan, 3)
    assert backend.put(keys, pages) == 3
    out = [torch.empty_like(p) for p in pages]
    assert backend.get(keys, out) == 3
    assert all(torch.equal(a, b) for a, b in zip(out, pages, strict=True))
