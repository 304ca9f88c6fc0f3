"""Holding a queued request while a request ahead of it computes the prefix they share.

A running request's prompt pages go into the tree after each prefill chunk
(``HiCache.cache_prompt``), so a request admitted after that chunk hits them. One admitted
before it (in the same step, or while the first waits for its prefetch or its turn)
matched nothing there and computes the same pages again beside the first: the shared part
twice, each request with part of the step's token budget. Rank 0 therefore keeps such a
request queued until the request ahead has the pages they share (computed, or taken from
a cache); admitted then, it matches them. A request is never held for pages its own
cache already holds, nor behind a request that has ended. Only rank 0 decides, so the
ranks agree by construction (the step broadcasts what it admits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from hicache_ray.engine.request import GenerateRequest

__all__ = ["SCAN_HELD", "SiblingHold", "shared_pages"]

SCAN_HELD = 32  # held requests one admission looks past at most (a step's cost stays small)


def shared_pages(a: Sequence[int], b: Sequence[int], page_size: int) -> int:
    """Leading whole pages that ``a`` and ``b`` share (a binary search over slice
    comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b)) // page_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        n = mid * page_size
        if a[:n] == b[:n]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SiblingHold:
    """Decides whether a queued request waits for one ahead of it (rank 0).

    Args:
        page_size: tokens per page.
        matched: leading whole pages of a request's prompt that this rank's cache holds
            (L1 and L2; a lookup that changes nothing).
    """

    def __init__(self, page_size: int, matched: Callable[[GenerateRequest], int]) -> None:
        self._page_size = page_size
        self._matched = matched

    def held(self, request: GenerateRequest, ahead: Iterable[tuple[GenerateRequest, int]]) -> bool:
        """Whether ``request`` waits: some request of ``ahead`` (each with the pages of its
        prompt it already has, or will take from a cache) shares more pages with it than
        that one has and than this rank's cache holds of it."""
        mine = -1  # looked up only when some request ahead lacks shared pages
        for other, has in ahead:
            if other.cache_salt != request.cache_salt:
                continue  # its pages are named apart: never shared
            shared = shared_pages(request.tokens, other.tokens, self._page_size)
            if shared <= has:
                continue
            if mine < 0:
                mine = self._matched(request)
            if shared > mine:
                return True
        return False
