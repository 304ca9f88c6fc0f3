"""The cache router's wait for a sibling's pages, on fake replicas (no Ray cluster): a call
whose pages a call in flight is computing waits while that ends its prefill first, keeps
its routing task without taking another call's, and goes when the pages come, when the
sibling ends, or at ``hold_s``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from actors.routing import CacheAwareRouter
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import Hits

PAGE = 4
SHARED = list(range(64))  # 16 pages the siblings share


def _router(**weights: float) -> tuple[Any, list[Any]]:
    router: Any = CacheAwareRouter.__new__(CacheAwareRouter)
    router.initialize_state(app="t", page_size=PAGE, **{"hold_s": 30.0, **weights})
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in "ab"]
    router._replicas = {r.replica_id.unique_id: r for r in replicas}
    router._replica_queue_len_cache = SimpleNamespace(get=lambda _: 0)
    prompt = page_hashes([*SHARED, *range(100, 116)], PAGE)
    router._inflight.sent("first", "a", 80.0, prompt)  # the first sibling, on a
    router._inflight.sent("second", "b", 80.0, page_hashes([*SHARED, *range(200, 216)], PAGE))
    return router, replicas


def _third() -> list[str]:
    return page_hashes([*SHARED, *range(300, 316)], PAGE)


def test_a_sibling_waits_then_goes_where_the_first_ones_pages_are() -> None:
    router, replicas = _router()
    seen: list[int] = []

    async def facts(names: list[str], hashes: list[str]) -> Any:
        seen.append(router.max_num_routing_tasks)
        if len(seen) < 3:  # the first sibling's prefill has not ended yet
            return {}, {}
        return {"a": Hits(device=16), "b": Hits(shared=16)}, {}

    router._facts = facts
    assert _names(asyncio.run(router._held(replicas, 80, _third()))) == ["a", "b"]
    assert seen == [4, 5, 5]  # while it waits, one more routing task for the other calls
    assert router._holding == 0 and router.max_num_routing_tasks == 4


def test_a_sibling_stops_waiting_when_the_first_one_ends_or_at_hold_s() -> None:
    router, replicas = _router()
    calls = 0

    async def facts(names: list[str], hashes: list[str]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # it failed: its pages never come
            router._inflight.finished("first")
            router._inflight.finished("second")
        return {}, {}

    router._facts = facts
    assert len(asyncio.run(router._held(replicas, 80, _third()))) == 2  # alike: at random
    assert calls == 2
    for weights in ({"hold_s": 0.05}, {"hold_s": 0}):  # waits that long; never waits
        router, replicas = _router(**weights)
        router._facts = lambda names, hashes: _nothing()
        assert _names(asyncio.run(router._held(replicas, 80, _third()))) in (["a", "b"], ["b", "a"])
        assert router._holding == 0


def _names(ranked: list[tuple[Any, float]]) -> list[str]:
    return [replica.replica_id.unique_id for replica, _ in ranked]


async def _nothing() -> Any:
    return {}, {}


def test_without_the_index_a_call_goes_where_least_work_is_pending() -> None:
    router, replicas = _router()
    router._inflight.sent("third", "a", 40.0)  # a: 120 tokens of work pending, b: 80

    async def silent(names: list[str], hashes: list[str]) -> Any:
        return None  # the index did not answer within wait_s

    router._facts = silent
    # no waiting without it
    assert _names(asyncio.run(router._held(replicas, 80, _third()))) == ["b", "a"]
    router._inflight.finished("third")
    assert len(asyncio.run(router._held(replicas, 80, _third()))) == 2  # alike: at random


def test_a_routed_call_counts_its_prefill_and_its_call_cost_where_it_went() -> None:
    router, replicas = _router(call=50.0)
    router._inflight.finished("first")
    router._inflight.finished("second")
    router._facts = lambda names, hashes: _held_by_b()
    tokens = [*SHARED, *range(300, 316)]  # 80 tokens, 16 of 20 pages in b's L1
    call = SimpleNamespace(request=SimpleNamespace(tokens=tokens))
    pending = SimpleNamespace(args=[call], metadata=SimpleNamespace(internal_request_id="x"))
    chosen = asyncio.run(router.choose_replicas(replicas, pending))
    assert [[r.replica_id.unique_id for r in group] for group in chosen] == [["b"], ["a"]]
    assert router._inflight.pending() == {"b": 16.0 + 50.0}  # 64 of 80 tokens cached


async def _held_by_b() -> Any:
    return {"a": Hits(), "b": Hits(device=16)}, {"b": 16}


def test_a_call_is_hashed_with_its_own_salt() -> None:
    """A tenant's call is ranked by the pages of its own salt (those its tenant's
    backups and events name); a call of no salt by the deployment's."""
    router: Any = CacheAwareRouter.__new__(CacheAwareRouter)
    router.initialize_state(app="t", page_size=PAGE, salt="dep")
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in "ab"]
    seen: list[list[str]] = []

    async def held(candidates: Any, tokens: int, hashes: list[str]) -> Any:
        seen.append(hashes)
        return [(candidates[0], 1.0), (candidates[1], 2.0)]

    router._held = held
    for salt in ("tenant-salt", ""):
        request = SimpleNamespace(tokens=SHARED, cache_salt=salt)
        pending = SimpleNamespace(
            args=[SimpleNamespace(request=request)],
            metadata=SimpleNamespace(internal_request_id=f"call-{salt}"),
        )
        asyncio.run(router.choose_replicas(replicas, pending))
    assert seen == [
        page_hashes(SHARED, PAGE, salt="tenant-salt"),
        page_hashes(SHARED, PAGE, salt="dep"),
    ]
