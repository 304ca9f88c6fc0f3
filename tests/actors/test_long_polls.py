"""The long polls of the cache-event path (no Ray cluster): a rank's journal and the
application's index each answer a subscriber that has everything as soon as something
changes, or after its ``wait_s``; a bad ``wait_s`` is refused."""

from __future__ import annotations

import asyncio
import threading

import pytest

from actors.event_poll import FlushWatch
from actors.index_actor import IndexActor
from hicache_ray.cache.events import (
    MAX_WAIT_S,
    BlockStored,
    CacheEvents,
    EventBatch,
    KVEventBatch,
    check_wait,
)
from hicache_ray.cache.tree import HiRadixTree


def test_a_wait_is_a_number_of_seconds_up_to_the_cap() -> None:
    assert check_wait(0) == 0.0 and check_wait(0.5) == 0.5 and check_wait(MAX_WAIT_S) == 10.0
    for bad, error in (("1", TypeError), (True, TypeError), (None, TypeError)):
        with pytest.raises(error, match="wait_s must be a number"):
            check_wait(bad)
    for bad_value in (-0.1, MAX_WAIT_S + 1, float("nan")):
        with pytest.raises(ValueError, match=r"wait_s must be in \[0, 10"):
            check_wait(bad_value)


def test_a_journal_poll_wakes_at_the_next_flush_from_another_thread() -> None:
    journal, watch = CacheEvents(HiRadixTree(4)), FlushWatch()

    async def poll() -> tuple[int, int]:
        started = journal.seq
        flusher = threading.Thread(target=journal.flush)  # the step thread
        waiting = asyncio.create_task(watch.wait(journal, started, MAX_WAIT_S))
        await asyncio.sleep(0)  # the poll is waiting now
        flusher.start()
        await waiting  # woken by the flush, not at MAX_WAIT_S
        flusher.join()
        return started, journal.seq

    assert asyncio.run(asyncio.wait_for(poll(), MAX_WAIT_S / 2)) == (0, 1)


def test_a_journal_poll_answers_at_once_when_a_batch_is_new_or_it_may_not_wait() -> None:
    journal, watch = CacheEvents(HiRadixTree(4)), FlushWatch()
    journal.flush()
    asyncio.run(asyncio.wait_for(watch.wait(journal, 0, MAX_WAIT_S), 1.0))  # batch 1 is new
    asyncio.run(asyncio.wait_for(watch.wait(journal, 1, 0.0), 1.0))  # no wait asked
    asyncio.run(watch.wait(journal, 1, 0.01))  # nothing comes: back after its wait


def _batch(seq: int) -> EventBatch:
    stored = BlockStored([f"page-{seq}"], None, [1, 2, 3, 4], 4, medium="GPU")
    return EventBatch("e", seq, KVEventBatch(0.0, [stored]))


def test_a_routers_poll_of_the_index_wakes_at_the_next_change() -> None:
    index = IndexActor("polled")  # its methods run on one event loop, as in its actor
    index.reset("a", _batch(1))

    async def poll() -> list[str]:
        feed = index.feed
        waiting = asyncio.create_task(index.changes(feed.epoch, feed.seq, MAX_WAIT_S))
        await asyncio.sleep(0)
        assert not waiting.done()  # the copy has everything: it waits
        index.apply("a", [_batch(2)])
        update = await waiting
        return [change.op for change in update.changes]

    assert asyncio.run(asyncio.wait_for(poll(), MAX_WAIT_S / 2)) == ["apply"]
    behind = asyncio.run(index.changes(index.feed.epoch, 0, MAX_WAIT_S))  # answered at once
    assert [change.op for change in behind.changes] == ["reset", "apply"]
    idle = asyncio.run(index.changes(index.feed.epoch, index.feed.seq, 0.01))
    assert idle.changes == [] and idle.whole is None
    with pytest.raises(ValueError, match="wait_s"):
        asyncio.run(index.changes(index.feed.epoch, index.feed.seq, -1.0))
