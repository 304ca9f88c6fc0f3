"""The one skeleton of the background threads (copies, L3 queries, reads and backups): a
daemon thread serving the items of its ``inbox`` in order until it gets ``None``; and
thread pools whose threads all run before their first job (:func:`started_pool`)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["InboxWorker", "started_pool"]

T = TypeVar("T")


class InboxWorker(threading.Thread, Generic[T]):
    """Serve each item put in ``inbox``: :meth:`handle` it; :meth:`failed` if that raised
    (a worker never dies of one item); :meth:`finished` in any case. ``None`` ends it."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.inbox: queue.SimpleQueue[T | None] = queue.SimpleQueue()

    def run(self) -> None:
        self.starting()
        while (item := self.inbox.get()) is not None:
            self.serve(item)

    def serve(self, item: T) -> None:
        """One item, on the calling thread: :meth:`handle`, :meth:`failed` if it raised,
        :meth:`finished` in any case."""
        try:
            self.handle(item)
        except Exception as exc:
            self.failed(item, exc)
        finally:
            self.finished(item)

    def starting(self) -> None:
        """On the thread, before the first item."""

    def handle(self, item: T) -> None:
        raise NotImplementedError

    def failed(self, item: T, exc: Exception) -> None:
        """``handle(item)`` raised ``exc``."""

    def finished(self, item: T) -> None:
        """Done with ``item``, whether it failed or not."""


def started_pool(threads: int, prefix: str) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads, every one of them started now.

    A ``ThreadPoolExecutor`` starts a thread on a submit that finds none idle, and that
    submit waits until the thread runs: a fresh rank's first L3 hit started its copy
    threads on its critical path, each start waiting for a core while the hit's other
    threads ran. Here each thread is held at a barrier until all have started.
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix=prefix)
    barrier = threading.Barrier(threads + 1)
    jobs = [pool.submit(barrier.wait) for _ in range(threads)]
    barrier.wait()
    for job in jobs:
        job.result()
    return pool
