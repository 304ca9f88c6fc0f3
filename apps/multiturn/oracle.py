"""The oracle: hit tokens an ideal LRU cache of a given capacity gets on a trace.

It replays the requests a run served, page by page: a request hits the longest run of its
leading full pages present (capped, like the runtime, to leave the last prompt token to
compute), which become most recent; after the requests admitted together have looked up,
each inserts the full pages of its prompt and answer (all but the answer's last token: its
KV is never computed) and, beyond the capacity, the least recently used *leaf* pages leave
(a page no cached page extends: evicting a page under a cached one would strand the latter,
which no lookup can reach). A page is named by its position-chained hash, so equal
prefixes share pages. ``capacity_pages`` None is the infinite cache: the ceiling of any
cache on this trace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from hicache_ray.keys import page_hashes

__all__ = ["OracleRequest", "lru_hit_tokens"]


@dataclass(frozen=True)
class OracleRequest:
    """One served request: its prompt and the tokens it generated."""

    prompt: list[int]
    output: list[int]


class _PrefixLRU:
    """Pages by chained hash, least recently used first; only leaves are evicted."""

    def __init__(self) -> None:
        self.order: OrderedDict[str, None] = OrderedDict()
        self.parent: dict[str, str | None] = {}
        self.children: dict[str, int] = {}

    def touch(self, chain: list[str]) -> None:
        """Use (or add) the pages of ``chain`` in order: each ends up more recent than
        its parent."""
        previous: str | None = None
        for h in chain:
            if h not in self.order:
                self.parent[h] = previous
                self.children[h] = 0
                if previous is not None:
                    self.children[previous] += 1
            self.order[h] = None
            self.order.move_to_end(h)
            previous = h

    def evict_to(self, capacity: int) -> None:
        while len(self.order) > capacity:
            victim = next(h for h in self.order if not self.children[h])
            del self.order[victim]
            del self.children[victim]
            parent = self.parent.pop(victim)
            if parent is not None:
                self.children[parent] -= 1


def lru_hit_tokens(
    waves: Sequence[Sequence[OracleRequest]], page_size: int, capacity_pages: int | None
) -> list[list[int]]:
    """Hit tokens of each request; ``waves`` are groups of requests admitted together
    (a round sent at once; one request per wave when they arrive one by one)."""
    cache = _PrefixLRU()
    out: list[list[int]] = []
    for wave in waves:
        hits = []
        for r in wave:
            usable = (len(r.prompt) - 1) // page_size
            found = []
            for h in page_hashes(r.prompt[: usable * page_size], page_size):
                if h not in cache.order:
                    break
                found.append(h)
            cache.touch(found)
            hits.append(len(found) * page_size)
        for r in wave:
            cache.touch(page_hashes(r.prompt + r.output[:-1], page_size))
            if capacity_pages is not None:
                cache.evict_to(capacity_pages)
        out.append(hits)
    return out
