"""The prefetch pipeline (L3 -> L2): a query thread and a read thread (:mod:`.reads`).

The scheduler thread creates one :class:`FetchTask` per admitted request that has enough
tokens past its L2 hit. The :class:`QueryWorker` hashes the request's whole pages and asks
storage how many *leading* pages past the local hit exist, in batches of
``storage_batch_size`` pages, stopping at the first gap. Once the ranks have agreed on how
many pages to fetch, the scheduler thread allocates host slots and hands the task to the
:class:`ReadWorker`, which reads and verifies pages into those slots batch by batch,
advancing ``pages_read`` (leading pages only) until done, cancelled or failed. An *eager*
task got its slots at admission: the query thread hands it to the reader itself, for the
pages it found, without waiting for a step (the ranks agree on what is used later).

Workers only read and write the task's own fields and its host slots; allocation, the
tree and every collective stay on the scheduler thread. A look-ahead (no request's task:
:meth:`PrefetchPipeline.look_ahead`) runs on the query thread, or on the thread that asks
for it (a peer's hint thread); the answers it leaves for the query are kept under a lock.
A task is ``settled`` once no worker will touch its slots again; slots freed before that
wait behind it as a fence.
:class:`PrefetchPipeline` starts both threads and stops them (``close``) in one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from hicache_ray.base.workers import InboxWorker
from hicache_ray.cache.controller.failure import Failure
from hicache_ray.cache.controller.fetch_task import FetchTask, no_progress
from hicache_ray.cache.controller.reads import ReadWorker
from hicache_ray.cache.controller.reads_first import ReadsFirst
from hicache_ray.cache.memory import HostPool
from hicache_ray.keys import ShardPlan, page_hashes
from hicache_ray.storage import StorageBackend

__all__ = ["FetchTask", "PrefetchPipeline"]

QUERY_BATCH_PAGES = 1024  # pages per L3 lookup at least (batch_size_pages when larger)
# A look-ahead's answer stands for its request's query this long: the query asks nothing,
# neither about the pages it found (the store client's cache would answer, as the store
# did moments ago) nor past the first it found absent (absence is not cached: asking again
# cost a store round trip at admission).
AHEAD_TRUST_S = 1.0
MAX_AHEAD = 64  # look-ahead answers kept at most (the oldest go first)

log = logging.getLogger(__name__)


class _Ahead(NamedTuple):
    """A look-ahead's answer: pages ``[start, end)`` found, at ``at`` (monotonic), and the
    prompt's page hashes."""

    start: int
    end: int
    at: float
    hashes: list[str]


class QueryWorker(InboxWorker[FetchTask]):
    """Hashes pages and counts leading stored pages past each task's local hit."""

    def __init__(self, storage: StorageBackend, plan: ShardPlan, page_size: int, batch: int):
        super().__init__("hicache-prefetch-query")
        # A lookup carries keys, not pages: its batches are larger than reads' (each costs
        # a store round trip on the L3 hit's critical path).
        batch = max(batch, QUERY_BATCH_PAGES)
        self._storage, self._plan, self._page_size, self._batch = storage, plan, page_size, batch
        self.progress: Callable[[], None] = no_progress  # see PrefetchPipeline.on_progress
        self.start_read: Callable[[FetchTask], None] = no_read  # PrefetchPipeline.submit_read
        self.prepare_read: Callable[[FetchTask], None] = no_prepare  # ReadWorker.prepare
        self._lock = threading.Lock()  # guards _ahead and _running: look-aheads run here too
        self._ahead: dict[tuple[bytes, str], _Ahead] = {}  # by (prompt, salt)
        self._running: dict[tuple[bytes, str], threading.Event] = {}  # look-aheads elsewhere

    def look_ahead_here(self, task: FetchTask) -> None:
        """Run look-ahead ``task`` on the calling thread (a peer's hint thread, which has
        nothing else to do: handing it to this worker's thread cost the lookup 0.2-2.3 ms on
        2 cores); a query of the same prompt meanwhile waits for its answer."""
        prompt, done = (task.key, task.salt), threading.Event()
        with self._lock:
            self._running[prompt] = done
        try:
            self.serve(task)
        finally:
            with self._lock:
                if self._running.get(prompt) is done:
                    del self._running[prompt]
            done.set()

    def handle(self, task: FetchTask) -> None:
        ahead = None if task.ahead else self._take_ahead(task)
        if ahead is not None:
            task.hashes = ahead.hashes
        else:
            task.hashes = page_hashes(task.key, self._page_size, salt=task.salt or None)
        if ahead is None:
            if task.eager and not task.cancelled:
                self.prepare_read(task)  # set up while the lookup below waits for the store
            task.local_total = task.start_page + self._leading(task, task.num_pages)
        else:  # found moments ago: asking again (the store client's cache) cost 0.5-1.4 ms
            task.local_total = max(task.start_page, min(task.num_pages, ahead.end))
        if task.ahead:
            found = _Ahead(task.start_page, task.local_total, time.monotonic(), task.hashes)
            with self._lock:
                self._ahead[(task.key, task.salt)] = found
                while len(self._ahead) > MAX_AHEAD:
                    del self._ahead[next(iter(self._ahead))]

    def _take_ahead(self, task: FetchTask) -> _Ahead | None:
        """A recent look-ahead's answer for ``task``'s prompt, from no later a page than
        ``task``'s own start (else None: ``task`` asks the store about every page)."""
        prompt = (task.key, task.salt)
        with self._lock:
            running = self._running.get(prompt)
        if running is not None:  # looked up on another thread right now: its answer is near
            running.wait(AHEAD_TRUST_S)
        with self._lock:
            ahead = self._ahead.pop(prompt, None)
        if ahead is None or ahead.start > task.start_page:
            return None
        return ahead if time.monotonic() - ahead.at <= AHEAD_TRUST_S else None

    def failed(self, task: FetchTask, exc: Exception) -> None:
        log.warning("prefetch query failed: %s", exc)  # a miss, never a failed request
        task.failure = Failure.QUERY_FAILED
        task.local_total = task.start_page

    def finished(self, task: FetchTask) -> None:
        if task.eager and not task.cancelled:
            # NOTE: read_started is set (by start_read) before the task reads as queried,
            # so no step sees it queried with its reads not begun and calls it settled.
            task.read_end = max(task.read_start, min(task.read_end, task.local_total))
            if task.read_end > task.read_start:
                self.start_read(task)
        task.mark_queried()
        if not task.ahead:  # a look-ahead's end changes no step's facts
            self.progress()

    def _leading(self, task: FetchTask, end: int) -> int:
        """Leading stored pages of ``task`` from its start, asked up to page ``end``."""
        found = 0
        per_page = len(self._plan.objects)
        for start in range(task.start_page, end, self._batch):
            if task.cancelled:
                break
            hashes = task.hashes[start : min(start + self._batch, end)]
            keys = self._plan.keys_of(hashes)
            pages = self._storage.exists(keys) // per_page
            found += pages
            if pages < len(hashes):
                break
        return found


class PrefetchPipeline:
    """The query and read threads over one storage backend, started and stopped together."""

    def __init__(
        self,
        storage: StorageBackend,
        plan: ShardPlan,
        host_pool: HostPool,
        batch_pages: int,
        read_threads: int,
        turn: ReadsFirst,
    ) -> None:
        """``turn``: told of every query and read, so that backups wait for them."""
        self.query = QueryWorker(storage, plan, host_pool.kv.page_size, batch_pages)
        self.read = ReadWorker(storage, plan, host_pool, batch_pages, read_threads)
        self.turn = turn
        self.query.start_read = self.submit_read
        self.query.prepare_read = self.read.prepare
        self._closed = False
        self.query.start()
        self.read.start()

    def on_progress(self, callback: Callable[[], None]) -> None:
        """Have the worker threads call ``callback`` whenever a task's query or read ends
        (a step loop wakes up for it instead of polling on a timer)."""
        self.query.progress = self.read.progress = callback

    def submit_query(self, task: FetchTask) -> None:
        self.turn.begin(task)
        self.query.inbox.put(task)

    def look_ahead(self, task: FetchTask, *, here: bool = False) -> None:
        """Look ``task``'s pages up ahead of the query of a request about to be admitted
        (:meth:`Claims.look_ahead`): the store client keeps the answers for it. ``task`` is
        no request's: nothing reads it, waits on it or holds backups for it. ``here``: on
        the calling thread, now (:meth:`QueryWorker.look_ahead_here`), else on the query
        thread's queue."""
        task.ahead = True
        if here:
            self.query.look_ahead_here(task)
        else:
            self.query.inbox.put(task)

    def submit_read(self, task: FetchTask) -> None:
        """Read ``task``'s pages ``[read_start, read_end)`` into its host slots (from the
        scheduler thread, or from the query thread for an eager task)."""
        task.read_started = True
        task.read_started_at = time.perf_counter()
        self.turn.begin(task)
        # NOTE: the query thread checks ``cancelled`` before it calls this, and the
        # scheduler thread may give the task up in between: then nothing ends it again, and
        # the backups it held would wait for it forever. (``cancelled`` is set before
        # ``give_up``, so one of the two ends it after this begin.)
        if task.cancelled:
            self.turn.end(task)
        self.read.inbox.put(task)

    def give_up(self, task: FetchTask) -> None:
        """``task`` holds backups no longer: every rank's reads of it are done (a rank's
        own end does not release it: its backups would take the cores and the store from
        the peers still reading), or its request no longer waits for it."""
        self.turn.end(task)

    def close(self) -> None:
        """Stop both threads after the work queued so far; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.query.inbox.put(None)
        self.query.join()  # first: the query thread hands eager tasks to the reader
        self.read.inbox.put(None)
        self.read.join()


def no_prepare(task: FetchTask) -> None:
    """The query worker's ``prepare_read`` until a pipeline wires its reader: nothing is
    set up ahead (the read sets up its batches itself)."""


def no_read(task: FetchTask) -> None:
    """The query worker's ``start_read`` until a pipeline wires its reader."""
    raise RuntimeError(f"no reader for eager task of {task.num_pages} pages")
