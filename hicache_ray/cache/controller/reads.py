"""The prefetch read thread: L3 pages into the host slots of each task.

:class:`ReadWorker` reads and verifies a task's pages batch by batch, leading pages first,
advancing ``pages_read`` until done, cancelled or failed. An eager task's first batch is
set up (its slots' views, the backend's checks: :meth:`StorageBackend.prepare_get`) on a
preparing thread while its lookup waits for the store. A large batch is read in lanes:
consecutive shares of its pages read at once on ``read_threads`` threads. Verifying a page
while copying it is one core's work (the checksum holds the GIL, the copy does not), so
one thread reads far below memory bandwidth and two reach it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from itertools import pairwise
from typing import NamedTuple

import torch

from hicache_ray.base.workers import InboxWorker, started_pool
from hicache_ray.cache.controller.failure import Failure
from hicache_ray.cache.controller.fetch_task import FetchTask, no_progress
from hicache_ray.cache.memory import HostPool
from hicache_ray.keys import ShardPlan
from hicache_ray.storage import PreparedRead, StorageBackend

__all__ = ["LANE_MIN_BYTES", "PARALLEL_READ_BYTES", "STAGED_BATCH_PAGES", "ReadWorker", "leading"]

log = logging.getLogger(__name__)

STAGED_BATCH_PAGES = 8  # pages per read when objects go through staging buffers
LANE_MIN_BYTES = 4 << 20  # a lane reads at least this much (a thread hand-off costs ~50 us)
# A store that reads one call on threads of its own (the ray store) is read in calls of at
# least this much: each call costs its round trips (a 256-page read of 32 MiB took 21 ms
# in one call, 26 in two, 32 in four).
PARALLEL_READ_BYTES = 32 << 20


class _Page(NamedTuple):
    """One page of a batch: its object keys, the buffers they are read into (its host
    slot's own bytes, or staging buffers for objects not contiguous there: ``staged``,
    ``(object index, buffer)``), and its host slot."""

    keys: list[str]
    buffers: list[torch.Tensor]
    staged: list[tuple[int, torch.Tensor]]
    slot: int


class _Prepared(NamedTuple):
    """A batch's read set up ahead: its first page and the backend's read."""

    start: int
    read: PreparedRead


class ReadWorker(InboxWorker[FetchTask]):
    """Reads and verifies pages into the host slots of each task, leading pages first."""

    def __init__(
        self,
        storage: StorageBackend,
        plan: ShardPlan,
        host_pool: HostPool,
        batch: int,
        threads: int = 1,
    ) -> None:
        super().__init__("hicache-prefetch-read")
        self._storage, self._plan, self._pool, self._batch = storage, plan, host_pool, batch
        self._staging: list[torch.Tensor] = []  # for objects not contiguous in the pool
        self._page_bytes = sum(o.num_bytes for o in plan.objects)
        # NOTE: a store that copies one read on threads of its own (the ray store) is read
        # in one lane: lanes on top of its threads oversubscribe the cores (an L3 hit of
        # 64 MiB read 92-128 ms in one lane, 151-165 ms in two, on 2 cores).
        threads = 1 if storage.reads_in_parallel else threads
        if storage.reads_in_parallel:
            self._batch = max(batch, PARALLEL_READ_BYTES // max(1, self._page_bytes))
        self._threads = threads
        self._lanes = (  # the lanes past the first; the first runs on this thread
            ThreadPoolExecutor(threads - 1, thread_name_prefix="hicache-prefetch-lane")
            if threads > 1
            else None
        )
        self.progress: Callable[[], None] = no_progress  # see PrefetchPipeline.on_progress
        rows = [host_pool.object_rows(o.local_layers, o.local_heads) for o in plan.objects]
        # each object's place in every slot, or None: objects go through staging buffers
        self._rows = None if any(r is None for r in rows) else [r for r in rows if r is not None]
        self._preparer = started_pool(1, "hicache-prefetch-prepare")

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._preparer.shutdown(wait=True)
            if self._lanes is not None:
                self._lanes.shutdown(wait=True)

    def prepare(self, task: FetchTask) -> None:
        """Set up ``task``'s first batch on the preparing thread (from the query thread,
        before an eager task's lookup: about 4 ms of a 4,096-token hit's critical path on
        2 cores overlap the store's round trip). Not for pages read through staging
        buffers (those are this thread's) nor in lanes (each lane sets up its own)."""
        if self._lanes is None and self._rows is not None:
            task.prepared = self._preparer.submit(self._prepare, task)

    def _prepare(self, task: FetchTask) -> _Prepared | None:
        """``task``'s first batch set up as one read into rows, if its pages are read so."""
        if self._lanes is not None or self._rows is None:
            return None
        start, end = task.read_start, min(task.read_start + self._batch, task.read_end)
        slots = task.host_pages[: end - start]
        keys = self._plan.keys_of(task.hashes[start : start + len(slots)])
        return _Prepared(start, self._storage.prepare_get_rows(keys, self._rows, slots))

    def handle(self, task: FetchTask) -> None:
        self._read(task)

    def failed(self, task: FetchTask, exc: Exception) -> None:
        log.warning("prefetch read failed: %s", exc)
        task.failure = Failure.READ_FAILED

    def finished(self, task: FetchTask) -> None:
        task.mark_read()
        self.progress()

    def _read(self, task: FetchTask) -> None:
        batch = self._batch
        if self._rows is None:
            batch = min(batch, STAGED_BATCH_PAGES)  # staging memory stays small and warm
        # Set up here when nothing did: an eager read after a look-ahead has no lookup to
        # overlap, and a thread of its own would only add a hand-off.
        prepared = task.prepared.result() if task.prepared is not None else self._prepare(task)
        for start in range(task.read_start, task.read_end, batch):
            if task.cancelled:
                return
            end = min(start + batch, task.read_end)
            if prepared is not None and prepared.start == start:
                done = self._read_prepared(prepared, end - start)
                prepared = None
            else:
                done = self._read_pages(self._pages(task, start, end, iter(self._staging)))
            task.pages_read = start + done
            if start + done < end:
                task.failure = Failure.READ_FAILED
                return

    def _pages(
        self, task: FetchTask, start: int, end: int, spare: Iterator[torch.Tensor]
    ) -> list[_Page]:
        """Pages ``[start, end)`` of ``task``, each with its slot's buffers."""
        slots = task.host_pages[start - task.read_start : end - task.read_start]
        return [self._page(task.hashes[start + i], slot, spare) for i, slot in enumerate(slots)]

    def _page(self, page_hash: str, slot: int, spare: Iterator[torch.Tensor]) -> _Page:
        page = _Page(list(self._plan.keys(page_hash)), [], [], slot)
        for i, obj in enumerate(self._plan.objects):
            view = self._pool.object_view(slot, obj.local_layers, obj.local_heads)
            if view is None:
                view = self._stage(spare, obj.shape)
                page.staged.append((i, view))
            page.buffers.append(view)
        return page

    def _stage(self, spare: Iterator[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """A staging buffer of ``shape``: reused across batches (fresh large buffers cost a
        page fault per 4 KiB, several times the copy itself)."""
        for buf in spare:
            if tuple(buf.shape) == shape:
                return buf
        buf = torch.empty(shape, dtype=self._pool.kv.dtype)
        self._staging.append(buf)
        return buf

    def _read_pages(self, pages: list[_Page]) -> int:
        """Read ``pages`` in lanes; the leading pages read, as one lane would count them."""
        lanes = min(self._threads, len(pages) * self._page_bytes // LANE_MIN_BYTES)
        if self._lanes is None or lanes < 2:
            return self._read_span(pages)
        cuts = [len(pages) * i // lanes for i in range(lanes + 1)]
        spans = list(pairwise(cuts))
        rest: list[Future[int]] = [
            self._lanes.submit(self._read_span, pages[a:b]) for a, b in spans[1:]
        ]
        try:
            first = self._read_span(pages[: cuts[1]])
        finally:  # no lane may still write into the slots once this task ends
            wait(rest)
        return leading(spans, [first, *(f.result() for f in rest)])

    def _read_prepared(self, prepared: _Prepared, count: int) -> int:
        """The first ``count`` pages of a prepared batch in one store call (prepared pages
        have no staged objects to place); the leading pages read."""
        per_page = len(self._plan.objects)
        return self._storage.get_prepared(prepared.read, count * per_page) // per_page

    def _read_span(self, pages: Sequence[_Page]) -> int:
        """Read consecutive ``pages`` in one store call and place their staged objects;
        the leading pages read."""
        keys = [k for p in pages for k in p.keys]
        buffers = [b for p in pages for b in p.buffers]
        read = self._storage.get(keys, buffers) // len(self._plan.objects)
        for page in pages[:read]:
            for i, buf in page.staged:
                obj = self._plan.objects[i]
                self._pool.write_object(page.slot, buf, obj.local_layers, obj.local_heads)
        return read


def leading(spans: Sequence[tuple[int, int]], counts: Sequence[int]) -> int:
    """Items done from the start when span ``i`` did its ``counts[i]`` leading ones."""
    done = 0
    for (a, b), n in zip(spans, counts, strict=True):
        done += n
        if n < b - a:
            break
    return done
