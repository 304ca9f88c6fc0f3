"""The cache index as a feed: the application's index and the log of what changed it, so
each router keeps its own copy and decides without a call on the request's path.

The index actor (:class:`actors.index_actor.IndexActor`) owns an :class:`IndexFeed`: every
batch it applies, every reset and every removal of a replica gets the feed's next
sequence number and is kept (the last ``keep`` of them). A router's :class:`IndexCopy`
asks for the changes after the last one it applied (:meth:`IndexFeed.changes`); when
they are no longer kept, or the feed is another one (the actor was made again), the
answer is the whole index instead (every replica's snapshot and the L3's pages). A copy
is as old as its last update: the router reads it only while it is fresh.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field

from hicache_ray.cache.events import EventBatch
from hicache_ray.serving.cache_index import CacheIndex

__all__ = ["FeedUpdate", "IndexCopy", "IndexFeed"]


@dataclass(frozen=True)
class Change:
    """One change of the index: ``op`` is ``apply`` (a replica's next batch), ``reset``
    (a replica's snapshot) or ``remove`` (a replica gone; ``batch`` None)."""

    op: str
    replica: str
    batch: EventBatch | None


@dataclass(frozen=True)
class FeedUpdate:
    """What a copy at some position needs: the changes since, or (``whole`` not None)
    every replica's snapshot and the L3's pages, oldest first."""

    epoch: str
    seq: int
    changes: list[Change] = field(default_factory=list)
    whole: dict[str, EventBatch] | None = None
    store: list[str] = field(default_factory=list)


class IndexFeed:
    """An index and its change log (see the module docstring)."""

    def __init__(self, keep: int = 4096, store_pages: int = 1 << 18) -> None:
        self.index = CacheIndex(store_pages)
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._log: deque[tuple[int, Change]] = deque(maxlen=keep)

    def apply(self, replica: str, batches: list[EventBatch]) -> bool:
        """Apply ``replica``'s batches in order; False at the first that does not follow."""
        for batch in batches:
            if not self.index.apply(replica, batch):
                return False
            self._record(Change("apply", replica, batch))
        return True

    def reset(self, replica: str, snapshot: EventBatch) -> None:
        self.index.reset(replica, snapshot)
        self._record(Change("reset", replica, snapshot))

    def remove(self, replica: str) -> None:
        self.index.remove(replica)
        self._record(Change("remove", replica, None))

    def changes(self, epoch: str, seq: int) -> FeedUpdate:
        """What a copy that applied this feed's changes up to ``seq`` needs."""
        kept = bool(self._log) and self._log[0][0] <= seq + 1
        if epoch == self.epoch and (seq == self.seq or kept):
            return FeedUpdate(self.epoch, self.seq, [c for n, c in self._log if n > seq])
        whole = {r: self.index.export(r) for r in self.index.replicas}
        return FeedUpdate(self.epoch, self.seq, whole=whole, store=self.index.store_pages())

    def _record(self, change: Change) -> None:
        self.seq += 1
        self._log.append((self.seq, change))


class IndexCopy:
    """A router's copy of the feed's index (see the module docstring)."""

    def __init__(self, store_pages: int = 1 << 18) -> None:
        self._store_pages = store_pages
        self.index = CacheIndex(store_pages)
        self.epoch, self.seq = "", 0

    def update(self, update: FeedUpdate) -> None:
        """Apply ``update``; a change that does not apply (it cannot, in order) leaves the
        copy unplaced, so the next update is the whole index."""
        if update.whole is not None:
            self.index = CacheIndex(self._store_pages)
            for replica, snapshot in update.whole.items():
                self.index.reset(replica, snapshot)
            self.index.add_store(update.store)
        for change in update.changes:
            if change.op == "remove":
                self.index.remove(change.replica)
            elif change.batch is None:
                raise ValueError(f"a {change.op} change without its batch")
            elif change.op == "reset":
                self.index.reset(change.replica, change.batch)
            elif not self.index.apply(change.replica, change.batch):
                self.epoch, self.seq = "", 0
                return
        self.epoch, self.seq = update.epoch, update.seq
