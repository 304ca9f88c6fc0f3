"""The cache router's cost: work saved per tier against work pending, the rule for new
prefixes, the in-flight tally, and the shared L3's pages in the index."""

from __future__ import annotations

import pytest

from hicache_ray.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
)
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import CacheIndex, Hits, down_snapshot
from hicache_ray.serving.route_cost import (
    InFlight,
    Leader,
    RouteWeights,
    hold,
    rank_replicas,
    ready_first,
    work,
)

PAGE = 4


def test_work_is_the_prefill_left_after_each_tiers_credit() -> None:
    weights = RouteWeights(l1=1.0, l2=0.5, l3=0.25)
    assert work(100, Hits(), PAGE, weights) == 100
    assert work(100, Hits(device=10, host=4, shared=8), PAGE, weights) == 100 - 40 - 8 - 8
    assert work(8, Hits(device=2), PAGE, weights) == 1  # the last token is always computed


def test_replicas_rank_by_work_saved_against_work_pending() -> None:
    hits = {"a": Hits(device=2), "b": Hits(device=1, host=3), "c": Hits()}
    weights = RouteWeights(l2=0.8)
    assert rank_replicas(["a", "b", "c"], hits, {}, 40, PAGE, weights) == ["b", "a", "c"]
    only_l1 = RouteWeights(l2=0.0)
    assert rank_replicas(["a", "b", "c"], hits, {}, 40, PAGE, only_l1) == ["a", "b", "c"]
    # b saves 13.6 tokens, a 8: up to 5.6 tokens pending on b leave it first
    assert rank_replicas(["a", "b"], hits, {"b": 5.0}, 40, PAGE, weights) == ["b", "a"]
    assert rank_replicas(["a", "b"], hits, {"b": 6.0}, 40, PAGE, weights) == ["a", "b"]
    assert rank_replicas(["x"], {}, {}, 40, PAGE) is None  # an unknown replica: no information


def test_a_hot_prefix_in_the_shared_store_moves_to_an_idle_replica() -> None:
    # a 1,024-token prefix in a's L1, and in the L3 for b: b reads it at l3 = 0.6
    hits = {"a": Hits(device=256), "b": Hits(shared=256)}
    weights = RouteWeights(l3=0.6)
    assert rank_replicas(["a", "b"], hits, {"a": 400.0}, 1100, PAGE, weights) == ["a", "b"]
    assert rank_replicas(["a", "b"], hits, {"a": 420.0}, 1100, PAGE, weights) == ["b", "a"]
    # without the L3 the same queue keeps the prefix where it is
    no_l3 = {"a": Hits(device=256), "b": Hits()}
    assert rank_replicas(["a", "b"], no_l3, {"a": 420.0}, 1100, PAGE, weights) == ["a", "b"]


def test_a_prefix_no_replica_holds_goes_where_there_is_room_and_least_work() -> None:
    none = {"a": Hits(), "b": Hits(), "c": Hits()}
    held = {"a": 900, "b": 100, "c": 500}  # pages cached in all
    assert rank_replicas(["a", "b", "c"], none, {}, 40, PAGE, held=held) == ["b", "c", "a"]
    # 400 more pages (1,600 tokens at 0.25: 400) weigh more than 399 tokens pending
    assert rank_replicas(["b", "c"], none, {"b": 399.0}, 40, PAGE, held=held) == ["b", "c"]
    assert rank_replicas(["b", "c"], none, {"b": 401.0}, 40, PAGE, held=held) == ["c", "b"]
    alike = {"a": 300, "b": 300}
    assert rank_replicas(["a", "b"], none, {}, 40, PAGE, held=alike) is None  # pow2
    # siblings of a new prefix: the first one's work sends the second elsewhere
    assert rank_replicas(["a", "b"], none, {"a": 40.0}, 40, PAGE, held=alike) == ["b", "a"]
    assert rank_replicas(["a", "b"], {"a": Hits(host=1)}, {}, 40, PAGE, held=held) == ["a", "b"]


def test_in_flight_work_counts_until_it_finishes_or_grows_old() -> None:
    now = [0.0]
    flight = InFlight(max_age_s=10.0, clock=lambda: now[0])
    flight.sent("r1", "a", 100.0)
    flight.sent("r2", "a", 50.0)
    flight.sent("r3", "b", 30.0)
    assert flight.pending() == {"a": 150.0, "b": 30.0}
    flight.moved("r2", "b")  # a was full: Serve sent it to b
    assert flight.pending() == {"a": 100.0, "b": 80.0}
    flight.finished("r1")
    flight.finished("unknown")
    assert flight.pending() == {"b": 80.0} and len(flight) == 2
    # another router's 2 requests on a: the mean of this router's (40 tokens) each
    assert flight.pending({"a": 2, "b": 2}) == {"a": 80.0, "b": 80.0}
    flight.forget("b")  # none in flight: the mean of the last ones sent (100, 50, 30)
    assert flight.pending({"a": 1}, typical=7.0) == {"a": 60.0}
    assert InFlight().pending({"a": 1}, typical=7.0) == {"a": 7.0}  # none ever sent
    flight.sent("r4", "a", 5.0)
    now[0] = 11.0
    flight.sent("r5", "a", 6.0)
    assert flight.pending() == {"a": 6.0}  # r4 never finished: dropped after max_age_s


def test_leaders_are_the_requests_in_flight_sharing_most_leading_pages() -> None:
    shared = list(range(40))  # 10 pages
    first = page_hashes([*shared, *range(100, 120)], PAGE)  # 15 pages
    second = page_hashes([*shared[:20], *range(200, 220)], PAGE)  # 5 shared pages, then its own
    flight = InFlight()
    assert flight.leaders(first) == {}
    flight.sent("r0", "a", 7.0)  # no pages known: never a leader
    flight.sent("r1", "a", 60.0, first)
    flight.sent("r2", "b", 40.0, second)
    flight.sent("r3", "b", 30.0, second)  # as many pages as r2, more work ahead
    sibling = page_hashes([*shared, *range(300, 340)], PAGE)
    # r0's work is ahead of r1 on a
    assert flight.leaders(sibling) == {"a": Leader("a", 10, 67.0), "b": Leader("b", 5, 40.0)}
    assert flight.leaders(page_hashes(list(range(500, 540)), PAGE)) == {}
    flight.finished("r1")
    assert flight.leaders(sibling) == {"b": Leader("b", 5, 40.0)}
    flight.forget("b")
    assert flight.leaders(sibling) == {} and flight.leaders([]) == {}


def test_siblings_spread_over_idle_replicas_then_wait_for_the_first_ones_pages() -> None:
    n, page, w = 1440, 16, RouteWeights(hold_s=30.0)  # 1,024 shared tokens (64 pages), then own
    none = {"a": Hits(), "b": Hits()}
    first = {"a": Leader("a", 64, float(n))}
    # the second sibling: b is idle, computing there ends first
    assert not hold(["a", "b"], none, {"a": float(n)}, n, page, w, first)
    # the third: both replicas busy with a sibling; waiting for the pages ends first
    both = {"a": Leader("a", 64, float(n)), "b": Leader("b", 64, float(n))}
    busy = {"a": float(n), "b": float(n)}
    assert hold(["a", "b"], none, busy, n, page, w, both)
    assert not hold(["a", "b"], none, busy, n, page, RouteWeights(), both)  # never by default
    # a's pages are in the index: the third goes there now; the fourth (a has the third's
    # 416 tokens more) waits for b's instead, and goes there once b's are in too
    at_a = {"a": Hits(device=64), "b": Hits()}
    assert not hold(["a", "b"], at_a, busy, n, page, w, both)
    assert hold(["a", "b"], at_a, {"a": n + 416.0, "b": float(n)}, n, page, w, both)
    at_both = {"a": Hits(device=64), "b": Hits(device=64)}
    assert not hold(["a", "b"], at_both, {"a": n + 416.0, "b": float(n)}, n, page, w, both)
    # a hot prefix a's L1 shows, not (yet) in the L3: a call on it still in flight there
    # computes nothing new, so nobody waits for it (b computes the prefix when a's queue
    # costs more)
    hot = {"a": Leader("a", 64, 416.0)}
    assert not hold(["a", "b"], at_a, {"a": 3 * 416.0}, n, page, w, hot)
    # a few shared pages behind a long queue are not worth the wait
    far = {"a": Leader("a", 4, 5_000.0)}
    assert not hold(["a", "b"], none, {"a": 5_000.0, "b": 100.0}, n, page, w, far)
    assert not hold(["a", "b"], none, busy, n, page, w, {})


def _batch(seq: int, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> EventBatch:
    return EventBatch("e", seq, KVEventBatch(float(seq), list(events)))


def _stored(hashes: list[str], medium: str) -> BlockStored:
    return BlockStored(hashes, None, [], PAGE, medium=medium)


def test_the_shared_stores_pages_count_for_every_replica() -> None:
    index = CacheIndex(store_pages=3)
    index.reset("r", _batch(1, AllBlocksCleared(), _stored(["p1", "p2"], "GPU")))
    assert index.apply("r", _batch(2, _stored(["p1", "p2", "p3"], "L3")))
    prompt = ["p1", "p2", "p3", "p4"]
    assert index.hits("r", prompt) == Hits(device=2, shared=1)
    assert index.hits("s", prompt) == Hits(shared=3)  # not heard of yet: the L3 all the same
    assert index.apply("r", _batch(3, AllBlocksCleared()))  # r's own tiers only
    assert index.hits("r", prompt) == Hits(shared=3) and index.size == 3
    assert index.apply("r", _batch(4, _stored(["p4"], "L3")))  # p1, the oldest, goes
    assert index.hits("s", prompt) == Hits() and index.hits("s", prompt[1:]) == Hits(shared=3)
    assert index.apply("r", _batch(5, BlockRemoved(["p3"], "L3")))
    assert index.hits("s", prompt[1:]) == Hits(shared=1)
    with pytest.raises(ValueError, match="store_pages"):
        CacheIndex(store_pages=-1)


def test_a_replica_whose_ranks_died_comes_last_until_its_new_snapshot() -> None:
    """Down (its ranks died, re-forming): it holds nothing, so by the score alone it
    would be the emptiest cache for a new prefix; it comes after every other instead."""
    old, new = page_hashes(list(range(16)), PAGE), page_hashes(list(range(50, 66)), PAGE)
    index = CacheIndex()
    for replica, epoch in (("a", "ea"), ("b", "eb")):
        stored = BlockStored(old, None, [], PAGE)
        index.reset(replica, EventBatch(epoch, 1, KVEventBatch(1.0, [AllBlocksCleared(), stored])))
    index.reset("a", down_snapshot(2.0))
    assert index.down == {"a"} and index.hits("a", old) == Hits() and index.position("a") == ("", 0)
    hits, held = index.facts(["a", "b"], new)
    order = rank_replicas(["a", "b"], hits, {}, 64, PAGE, held=held)
    assert order == ["a", "b"]  # by room alone
    assert ready_first(order, index.down) == ["b", "a"]  # last, not left out
    assert ready_first(["a", "c", "b"], {"a", "c"}) == ["b", "a", "c"]
    index.reset("a", EventBatch("ea2", 0, KVEventBatch(3.0, [AllBlocksCleared()])))  # re-formed
    assert index.down == frozenset()
