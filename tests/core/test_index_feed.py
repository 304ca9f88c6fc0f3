"""The index as a feed: a router's copy, updated at random moments from a log that may
have dropped what it needs, always ends equal to the feed's index."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_ray.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
)
from hicache_ray.serving.cache_index import CacheIndex, down_snapshot
from hicache_ray.serving.index_feed import IndexCopy, IndexFeed

_PAGES = [f"p{i}" for i in range(8)]
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "drop", "l3", "reset", "remove", "down", "gap", "pull"]),
        st.sampled_from(["a", "b"]),
        st.lists(st.sampled_from(_PAGES), min_size=1, max_size=3),
    ),
    max_size=40,
)


def _state(index: CacheIndex) -> tuple[object, ...]:
    replicas = sorted(index.replicas)
    return (
        [(r, index.position(r), index.export(r).batch.events) for r in replicas],
        index.store_pages(),
        sorted(index.down),
    )


def _batch(epoch: str, seq: int, events: list[object]) -> EventBatch:
    return EventBatch(epoch, seq, KVEventBatch(float(seq), events))  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, keep=st.integers(1, 6))
def test_a_copy_follows_the_feed_through_gaps_and_resets(
    ops: list[tuple[str, str, list[str]]], keep: int
) -> None:
    feed, copy = IndexFeed(keep=keep), IndexCopy()
    for op, replica, pages in ops:
        epoch, seq = feed.index.position(replica)
        if op == "pull":
            copy.update(feed.changes(copy.epoch, copy.seq))
        elif op == "reset" or not epoch:
            feed.reset(replica, _batch(f"{replica}{len(pages)}", 1, [AllBlocksCleared()]))
        elif op == "remove":
            feed.remove(replica)
        elif op == "down":  # its ranks died: nothing held, no journal until its snapshot
            feed.reset(replica, down_snapshot(float(len(pages))))
        elif op == "gap":  # a batch that does not follow: refused, nothing recorded
            assert not feed.apply(replica, [_batch(epoch, seq + 2, [AllBlocksCleared()])])
        else:
            event: object = (
                BlockRemoved(pages, "GPU")
                if op == "drop"
                else BlockStored(pages, None, [], 4, medium="L3" if op == "l3" else "GPU")
            )
            assert feed.apply(replica, [_batch(epoch, seq + 1, [event])])
    copy.update(feed.changes(copy.epoch, copy.seq))
    assert (copy.epoch, copy.seq) == (feed.epoch, feed.seq)
    assert _state(copy.index) == _state(feed.index)


def test_a_copy_of_another_feed_starts_over_from_the_whole_index() -> None:
    feed, copy = IndexFeed(), IndexCopy()
    feed.reset("a", _batch("e", 1, [AllBlocksCleared(), BlockStored(["p1"], None, [], 4)]))
    copy.update(feed.changes(copy.epoch, copy.seq))
    update = feed.changes(copy.epoch, copy.seq)
    assert update.whole is None and update.changes == []  # up to date: nothing to send
    other = IndexFeed()  # the index actor was made again
    other.reset("b", _batch("f", 1, [AllBlocksCleared()]))
    update = other.changes(copy.epoch, copy.seq)
    assert update.whole is not None
    copy.update(update)
    assert copy.index.replicas == ["b"] and copy.epoch == other.epoch
