"""Page allocator shared by the device and host pools.

Pages are handed out lowest id first; freed pages are queued and merged (sorted) into the
free list only when the list runs short, so frees stay O(1) and allocations tend to be
contiguous runs, which the transfer engine copies in one piece. A bitmap of pages in use
turns a double free or a double allocation into an :class:`AllocatorError` at once.

A page freed while a copy may still read or write it is freed *behind a fence* (anything
with a ``settled`` property, such as a transfer): it counts as neither used nor free until
the fence settles, so it is never handed out while that copy can still touch it.

Not thread-safe: the owner (one rank's cache) calls it from one thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from hicache_ray.base.errors import AllocatorError

__all__ = ["Fence", "PageAllocator"]


class Fence(Protocol):
    """Something that may still touch pages until it has settled (a transfer, a read task)."""

    @property
    def settled(self) -> bool: ...


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
        self._fenced: list[tuple[Fence, list[int]]] = []  # freed, waiting on their fence
        self._num_fenced = 0

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free_pages(self) -> int:
        if self._fenced:
            self._release_settled()
        return len(self._free) + len(self._pending)

    @property
    def num_fenced_pages(self) -> int:
        """Freed pages still waiting for a copy that may touch them to settle."""
        if self._fenced:
            self._release_settled()
        return self._num_fenced

    @property
    def num_used_pages(self) -> int:
        return self._num_pages - self.num_free_pages - self._num_fenced

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

    def free(self, pages: Iterable[int], fence: Fence | None = None) -> None:
        """Return pages; raises AllocatorError on a page that is not in use.

        With ``fence``, the pages become allocatable only once ``fence.settled`` is true.
        """
        in_use = self._in_use
        freed = list(pages)
        for i, page in enumerate(freed):
            if not 0 <= page < self._num_pages or not in_use[page]:
                for undo in freed[:i]:  # leave the allocator as it was
                    in_use[undo] = 1
                raise AllocatorError(f"{self.name}: page {page} freed but not in use")
            in_use[page] = 0
        if fence is not None and not fence.settled:
            self._fenced.append((fence, freed))
            self._num_fenced += len(freed)
        else:
            self._pending.extend(freed)

    def _release_settled(self) -> None:
        waiting = []
        for fence, pages in self._fenced:
            if fence.settled:
                self._pending.extend(pages)
                self._num_fenced -= len(pages)
            else:
                waiting.append((fence, pages))
        self._fenced = waiting

    def _merge(self) -> None:
        self._free.extend(self._pending)
        self._pending.clear()
        self._free.sort(reverse=True)

    def check_integrity(self) -> None:
        """Assert free + used == capacity and that the bitmap agrees with the free lists."""
        free = self._free + self._pending + [p for _, pages in self._fenced for p in pages]
        assert len(free) == len(set(free)), f"{self.name}: duplicate page in free list"
        assert all(not self._in_use[p] for p in free), f"{self.name}: free page marked used"
        assert self._num_fenced == sum(len(p) for _, p in self._fenced), f"{self.name}: fenced"
        assert sum(self._in_use) + len(free) == self._num_pages, f"{self.name}: pages leaked"
