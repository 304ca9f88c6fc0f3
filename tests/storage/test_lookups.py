"""Round trips to the store: a backup's pages cost one lookup, then one write of the absent
ones (``exists_each`` answers every key and ``put`` trusts it)."""

from __future__ import annotations

from typing import Any

from hicache_ray.storage import MemoryObjects, PagedBackend
from hicache_ray.storage.base import StorageBackend
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
