"""The oracle: hit tokens an ideal LRU cache of a given capacity gets on a trace.

It replays the requests a run served, page by page: a request hits the longest run of its
leading full pages present (capped, like the runtime, to leave the last prompt token to
compute), which become most recent; after the requests admitted together have looked up,
each inserts the full pages of its prompt and answer (all but the answer's last token: its
KV is never computed) and the least recently used pages beyond the capacity leave. A page is
named by its position-chained hash, so equal prefixes share pages. ``capacity_pages`` None
is the infinite cache: the ceiling of any cache on this trace.
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


def lru_hit_tokens(
    waves: Sequence[Sequence[OracleRequest]], page_size: int, capacity_pages: int | None
) -> list[list[int]]:
    """Hit tokens of each request; ``waves`` are groups of requests admitted together
    (a round sent at once; one request per wave when they arrive one by one)."""
    cache: OrderedDict[str, None] = OrderedDict()
    out: list[list[int]] = []
    for wave in waves:
        hits = []
        for r in wave:
            usable = (len(r.prompt) - 1) // page_size
            found = 0
            for h in page_hashes(r.prompt[: usable * page_size], page_size):
                if h not in cache:
                    break
                cache.move_to_end(h)
                found += 1
            hits.append(found * page_size)
        for r in wave:
            for h in page_hashes(r.prompt + r.output[:-1], page_size):
                cache[h] = None
                cache.move_to_end(h)
            while capacity_pages is not None and len(cache) > capacity_pages:
                cache.popitem(last=False)
        out.append(hits)
    return out
