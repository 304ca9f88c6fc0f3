"""Page allocator shared by the device and host pools.

Pages are handed out lowest id first; freed pages are queued and merged (sorted) into the
free list only when the list runs short, so frees stay O(1) and allocations tend to be
contiguous runs, which the transfer engine copies in one piece. A bitmap of pages in use
turns a double free or a double allocation into an :class:`AllocatorError` at once.

Not thread-safe: the owner (one rank's cache) calls it from one thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from hicache_ray.errors import AllocatorError

__all__ = ["PageAllocator"]


class PageAllocator:
    """Free-list allocator over page ids ``[0, num_pages)``."""

    def __init__(self, num_pages: int, *, name: str = "pool") -> None:
        if num_pages <= 0:
            raise ValueError(f"{name}: num_pages must be positive, got {num_pages}")
        self.name = name
        self._num_pages = num_pages
        # Descending, so pop() from the end yields the lowest id.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._pending: list[int] = []  # freed, not merged yet
        self._in_use = bytearray(num_pages)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._pending)

    @property
    def num_used_pages(self) -> int:
        return self._num_pages - self.num_free_pages

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` pages (ascending ids where possible); None when short."""
        if num_pages <= 0:
            return []
        if num_pages > len(self._free):
            if num_pages > self.num_free_pages:
                return None
            self._merge()
        pages = self._free[-num_pages:]
        del self._free[-num_pages:]
        pages.reverse()
        in_use = self._in_use
        for page in pages:
            if in_use[page]:
                raise AllocatorError(f"{self.name}: page {page} handed out twice")
            in_use[page] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages; raises AllocatorError on a page that is not in use."""
        in_use = self._in_use
        freed = list(pages)
        for i, page in enumerate(freed):
            if not 0 <= page < self._num_pages or not in_use[page]:
                for undo in freed[:i]:  # leave the allocator as it was
                    in_use[undo] = 1
                raise AllocatorError(f"{self.name}: page {page} freed but not in use")
            in_use[page] = 0
        self._pending.extend(freed)

    def _merge(self) -> None:
        self._free.extend(self._pending)
        self._pending.clear()
        self._free.sort(reverse=True)

    def check_integrity(self) -> None:
        """Assert free + used == capacity and that the bitmap agrees with the free lists."""
        free = self._free + self._pending
        assert len(free) == len(set(free)), f"{self.name}: duplicate page in free list"
        assert all(not self._in_use[p] for p in free), f"{self.name}: free page marked used"
        assert sum(self._in_use) + len(free) == self._num_pages, f"{self.name}: pages leaked"
