"""One request's L3 prefetch on one rank, shared by the scheduler thread and the query
and read threads of the prefetch pipeline (:mod:`.prefetch`, :mod:`.reads`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from hicache_ray.cache.controller.failure import Failure

__all__ = ["FetchTask", "no_progress"]


class FetchTask:
    """One request's L3 work on this rank; page numbers count from the prompt's start.

    Set by the scheduler thread: ``host_pages`` for pages ``[read_start, read_end)``;
    ``eager`` when they were reserved at admission, before the query (the query thread then
    shortens ``read_end`` to what it found and starts the reads itself).
    Set by the workers: ``hashes``, ``local_total`` (-1 until the query finished),
    ``pages_read`` (leading pages valid in L2, from ``read_start``), ``read_finished``,
    ``failure`` (why reading stopped early), ``prepared`` (the first batch's read, set up
    while the lookup ran: :meth:`ReadWorker.prepare`).
    """

    def __init__(self, key: bytes, num_pages: int, start_page: int, salt: str) -> None:
        self.key = key
        self.num_pages = num_pages
        self.start_page = start_page  # pages already in L1/L2 here at admission
        self.salt = salt
        self.hashes: list[str] = []
        self.local_total = -1
        self.host_pages: list[int] = []
        self.read_start = self.read_end = start_page
        self.pages_read = start_page
        self.read_started = False
        self.eager = False
        self.ahead = False  # a look-ahead: no request's (PrefetchPipeline.look_ahead)
        self.cancelled = False
        self.failure: Failure | None = None
        self.prepared: Future[Any] | None = None
        self.queried = threading.Event()
        self.read_finished = threading.Event()
        # perf_counter times of the query's end, the reads' start and end (0: not yet):
        # where an L3 hit's time to first token went (RequestResult.ttft_split)
        self.queried_at = self.read_started_at = self.read_done_at = 0.0
        self.created_at = time.perf_counter()  # its query is submitted as it is made

    def mark_queried(self) -> None:
        """The query thread is done with this task (its ``local_total`` is set)."""
        self.queried_at = time.perf_counter()
        self.queried.set()

    def mark_read(self) -> None:
        """The read thread is done with this task's slots."""
        self.read_done_at = time.perf_counter()
        self.read_finished.set()

    @property
    def settled(self) -> bool:
        """No worker will touch ``host_pages`` again."""
        return not self.read_started or self.read_finished.is_set()


def no_progress() -> None:
    """The workers' progress callback until a step loop sets one (``on_progress``)."""
