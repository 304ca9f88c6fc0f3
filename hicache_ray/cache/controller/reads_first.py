"""L3 reads before L3 writes: a rank's backups wait while an L3 hit is being read.

An L3 hit's query and reads are on a request's critical path; a backup is not. Both use
the same cores, the same store shards and, on the ray store, the same object store: on a
fresh TP=2 deployment a 4,096-token L3 hit that arrived while the previous request's pages
were being backed up waited 84 ms for its pages (median of 4), against 56 ms when the
backup had ended first. So the backup thread asks :class:`ReadsFirst` for its turn before
each store call, and waits while any prefetch task is in flight: from its query until the
step that agrees every rank's reads of it are done (a rank done early would take the cores
and the store from the peers still reading; on a TP=2 hit the last rank's read ended 5-11
ms after the first's), or until its request gives it up.

Backups still keep up: once their backlog holds ``1/BACKLOG_SHARE`` of L2 (pages they
lock until stored, which hits then lack) they stop yielding, as they stop pausing for
forward passes. Every wait is counted (``ControllerStats.backup_waited_for_reads``).

Nor do they yield while the rank's own thread waits for them (``CacheController.settle``):
no step can then agree a read done, so a held backup would hold the caller to its timeout.

A backup also starts a moment after it was submitted (:meth:`ReadsFirst.after`), not at
once: a request's pages reach L2, and its backup is submitted, as it finishes, which is
when the next request (the next turn, the next in the queue) is admitted and looks L3 up.
A backup that started first ran through that admission and lookup, where waiting for
reads cannot stop it; delayed, it sees the next request's query submitted and waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["BACKLOG_SHARE", "ReadsFirst"]

BACKLOG_SHARE = 8  # backups behind by 1/8 of L2 yield to nothing (reads, forward passes)


class ReadsFirst:
    """The prefetch tasks in flight on this rank; backups wait for none.

    A task counts from its query's submission until every rank's reads of it are agreed
    done, or until its request gives it up (``end``, from the claims): a read that runs on
    for nobody holds no backup.

    Args:
        host_pages: L2's size in pages (the backlog past which backups stop yielding).
    """

    def __init__(self, host_pages: int) -> None:
        self._cond = threading.Condition()
        self._reads: set[object] = set()  # guarded: the tasks in flight
        self._backlog = 0  # guarded: pages of backups submitted and not finished
        self._limit = max(1, host_pages)
        self._closed = False  # guarded
        self._awaited = 0  # guarded: callers waiting for every backup (``awaited``)
        self.waits = 0  # backups that waited (written by the backup thread only)
        self.delayed = 0  # guarded: backups that waited in ``after``

    def begin(self, task: object) -> None:
        """``task``'s query or read was submitted (again: no change)."""
        with self._cond:
            self._reads.add(task)
            self._cond.notify_all()  # a delayed backup now waits for it (``after``)

    def end(self, task: object) -> None:
        """``task`` is done, failed or given up (again: no change)."""
        with self._cond:
            self._reads.discard(task)
            if not self._reads:
                self._cond.notify_all()

    @property
    def reading(self) -> int:
        """Tasks in flight."""
        with self._cond:
            return len(self._reads)

    def backlog(self, pages: int) -> None:
        """``pages`` more (or, negative, fewer) backup pages wait to be stored."""
        with self._cond:
            self._backlog += pages
            if not self._yielding():  # behind now, or no read holds it: wake the waiters
                self._cond.notify_all()

    def after(self, ready_at: float) -> None:
        """On the backup thread, before a task's first store call: return at ``ready_at``
        (``time.monotonic``, see ``BACKUP_DELAY_S``), or as soon as a query or read is
        submitted (:meth:`turn` then holds the backup until it is done), the backlog is
        too large to wait, every backup is awaited or the turn is closed."""
        with self._cond:
            if ready_at > time.monotonic():
                self.delayed += 1
                self._cond.notify_all()  # whoever watches ``delayed`` (tests)
            while not (self._reads or self._urgent()):
                left = ready_at - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def turn(self) -> bool:
        """On the backup thread, before a store call: return once no query or read runs
        (or the backlog is too large to wait); True when it waited."""
        with self._cond:
            if not self._yielding():
                return False
            self.waits += 1
            self._cond.notify_all()  # whoever watches ``waits`` (tests)
            self._cond.wait_for(lambda: not self._yielding())
            return True

    @contextlib.contextmanager
    def awaited(self) -> Iterator[None]:
        """While the caller waits for every backup to finish: hold none (the step that
        would agree the reads done cannot run until the caller returns)."""
        with self._cond:
            self._awaited += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._awaited -= 1

    def close(self) -> None:
        """Stop holding backups (the pipelines are closing)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _urgent(self) -> bool:
        """Backups wait for nothing: they are behind, awaited, or the turn is closed."""
        behind = self._backlog * BACKLOG_SHARE >= self._limit
        return behind or self._closed or bool(self._awaited)

    def _yielding(self) -> bool:
        return bool(self._reads) and not self._urgent()
