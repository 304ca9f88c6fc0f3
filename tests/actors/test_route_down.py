"""The cache router with a replica down (its ranks died and re-form), on fake replicas
(no Ray cluster): every call goes to the others first, whatever the down one's score,
and the down one comes back with its re-formed ranks' snapshot."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from actors.routing import CacheAwareRouter
from hicache_ray.cache.events import AllBlocksCleared, BlockStored, EventBatch, KVEventBatch
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import down_snapshot

PAGE = 4


def _snapshot(epoch: str, hashes: list[str]) -> EventBatch:
    events = [AllBlocksCleared(), BlockStored(hashes, None, [], PAGE)]
    return EventBatch(epoch, 1, KVEventBatch(1.0, events))  # type: ignore[arg-type]


def _order(router: Any, prompt: list[int]) -> list[str]:
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in "ab"]
    hashes = page_hashes(prompt, PAGE)
    ranked = asyncio.run(router._ranked(replicas, len(prompt), hashes, False))
    return [replica.replica_id.unique_id for replica, _ in ranked]


def test_calls_avoid_a_replica_whose_ranks_died_until_it_is_back() -> None:
    router: Any = CacheAwareRouter.__new__(CacheAwareRouter)
    router.initialize_state(app="t", page_size=PAGE)
    router._replica_queue_len_cache = SimpleNamespace(get=lambda _: 0)
    router._follower = SimpleNamespace(done=lambda: False)  # no task keeping the copy
    held = list(range(400, 464))  # a's: 16 pages; b holds more of another prompt
    index = router._copy.index
    index.reset("a", _snapshot("ea", page_hashes(held, PAGE)))
    index.reset("b", _snapshot("eb", page_hashes(list(range(600, 700)), PAGE)))
    router._copy_at = time.monotonic()  # fresh
    new = list(range(800, 840))
    assert _order(router, new) == ["a", "b"]  # the roomier cache for a new prefix
    index.reset("a", down_snapshot(2.0))
    assert _order(router, new) == ["b", "a"]  # down: last, even with the most room
    assert _order(router, [*held, 1, 2, 3, 4]) == ["b", "a"]  # its pages died with it
    index.reset("a", _snapshot("ea2", []))  # re-formed, empty
    assert _order(router, new) == ["a", "b"]
    router._copy_at = float("-inf")  # a stale copy tells nothing of who is down
    assert router._down() == frozenset()
