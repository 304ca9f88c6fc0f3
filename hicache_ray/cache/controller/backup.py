"""The backup pipeline (L2 -> L3): one thread storing host pages, in prefix order.

The scheduler thread submits one :class:`BackupTask` per tree node whose host copy the
ranks agreed is written, parents before children (writes are acknowledged in submission
order, and a path is written parents first). The :class:`BackupWorker` skips the leading
pages already stored, stores the rest in batches, and stops at the first failure. A task
whose parent's backup did not store every page is skipped: a stored prefix never has a
hole. The node stays locked (its host slots cannot be evicted) until the scheduler thread
acknowledges the task.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

from hicache_ray.base.workers import InboxWorker
from hicache_ray.cache.controller.failure import Failure
from hicache_ray.cache.controller.reads_first import ReadsFirst
from hicache_ray.cache.memory import HostPool
from hicache_ray.cache.tree import TreeNode
from hicache_ray.keys import ShardPlan
from hicache_ray.keys.plan import ObjectSpec
from hicache_ray.storage import StorageBackend

__all__ = ["BACKUP_DELAY_S", "BackupPipeline", "BackupTask", "lower_priority"]

log = logging.getLogger(__name__)

# A backup stores at most this many bytes per call (and at most ``batch_size_pages``
# pages): a pause (``paused``) takes effect within one such call, and the pages copied
# out of non-contiguous layouts stay few. Every call costs store round trips and, on the
# ray store, objects of their own that each later read fetches: a 4,096-token L3 hit on
# a TP=2 deployment waited 79 ms over its L1 hit (medians of 5) with the 2 MiB calls of
# before, 60 ms with 16 MiB ones.
BACKUP_CALL_BYTES = 16 << 20
# A backup starts this long after its submission (at once when its rank awaits every
# backup, or when backups are behind: ``ReadsFirst.after``). Fresh TP=2 deployments, a
# 4,096-token L3 hit sent right after a 32-token request: that request's backup (2 pages,
# 10-27 ms on 2 cores) ran through the hit's admitting step (1 ms alone, 7-10 ms beside
# it) and lookup; 30 ms later, it waits for the hit's reads instead.
BACKUP_DELAY_S = 0.03


def lower_priority(niceness: int = 10) -> None:
    """Make the calling thread yield the CPU to others (Linux: per-thread nice value)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


class BackupTask:
    """Store one node's pages. Set by the worker: ``stored_pages``, ``failure``, ``finished``."""

    def __init__(
        self,
        node: TreeNode,
        hashes: list[str],
        host_pages: list[int],
        parent: BackupTask | None,
        owner: str = "",
    ) -> None:
        self.node = node
        self.owner = owner  # the tenant its pages count against in L3 ("": none)
        self.hashes = hashes
        self.host_pages = host_pages
        self.parent = parent  # None: the parent is the root or already stored
        self.stored_pages = 0
        self.num_bytes = 0
        self.failure: Failure | None = None
        self.finished = threading.Event()  # set once the worker is done with the task
        self.submitted_at = time.monotonic()

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    @property
    def ok(self) -> bool:
        return self.done and self.failure is None

    @classmethod
    def already_stored(cls, node: TreeNode) -> BackupTask:
        """The record of a node whose pages came from storage (nothing to write)."""
        task = cls(node, [], [], None)
        task.finished.set()
        return task


class BackupWorker(InboxWorker[BackupTask]):
    """Stores the pages of each task, leading pages first, stopping at the first failure."""

    def __init__(self, storage: StorageBackend, plan: ShardPlan, host_pool: HostPool, batch: int):
        super().__init__("hicache-backup")
        self._storage, self._plan, self._pool = storage, plan, host_pool
        self.turn = ReadsFirst(host_pool.num_pages)  # L3 reads go first
        written = sum(o.num_bytes for o in plan.objects if o.writer)
        self._batch = max(1, min(batch, BACKUP_CALL_BYTES // max(1, written)))
        self.open = threading.Event()  # cleared while the rank computes (see ``paused``)
        self.open.set()
        self.delay_s = BACKUP_DELAY_S

    def starting(self) -> None:
        lower_priority()  # backups are background work: prefills and decodes go first

    def handle(self, task: BackupTask) -> None:
        self.turn.after(task.submitted_at + self.delay_s)
        if task.parent is not None and not task.parent.ok:
            task.failure = Failure.PARENT_NOT_STORED
        else:
            self._store(task)

    def failed(self, task: BackupTask, exc: Exception) -> None:
        log.warning("backup failed: %s", exc)
        task.failure = Failure.WRITE_FAILED

    def finished(self, task: BackupTask) -> None:
        self.turn.backlog(-len(task.hashes))
        task.finished.set()

    def _wait_turn(self) -> None:
        """Before a store call: wait while the rank computes, then while its L3 queries
        or reads run (:class:`ReadsFirst`), then for the forward pass again if it did."""
        while True:
            self.open.wait()
            if not self.turn.turn():
                return

    def _store(self, task: BackupTask) -> None:
        plan = self._plan
        mine = [i for i, obj in enumerate(plan.objects) if obj.writer]
        writers = [plan.objects[i] for i in mine]
        if not writers:  # another rank writes this rank's objects
            task.stored_pages = len(task.hashes)
            return
        keys = [[ks[i] for i in mine] for ks in map(plan.keys, task.hashes)]
        # One lookup for every page of the node (not only the leading ones): the put below
        # writes the absent pages without asking again, and present ones are never read
        # out of the pool.
        self._wait_turn()
        flat = self._storage.exists_each([k for page in keys for k in page])
        n = len(writers)
        missing = [not all(flat[p * n : (p + 1) * n]) for p in range(len(keys))]
        for start in range(0, len(keys), self._batch):
            end = min(start + self._batch, len(keys))
            todo = [p for p in range(start, end) if missing[p]]
            if todo:
                self._wait_turn()
                if not self._put(task, todo, keys, writers):
                    return
            task.stored_pages = end

    def _put(
        self, task: BackupTask, todo: list[int], keys: list[list[str]], writers: list[ObjectSpec]
    ) -> bool:
        """Store the pages ``todo``; False (``stored_pages`` and ``failure`` set) when the
        store took fewer."""
        batch_keys = [k for p in todo for k in keys[p]]
        pages = [
            self._pool.read_object(task.host_pages[p], o.local_layers, o.local_heads)
            for p in todo
            for o in writers
        ]
        stored = self._storage.put(batch_keys, pages, owner=task.owner)
        task.num_bytes += sum(p.nbytes for p in pages[:stored])
        if stored < len(batch_keys):
            task.stored_pages = todo[stored // len(writers)]
            task.failure = Failure.WRITE_FAILED
            return False
        return True


class BackupPipeline:
    """The backup thread over one storage backend, started and stopped in one place."""

    def __init__(
        self, storage: StorageBackend, plan: ShardPlan, host_pool: HostPool, batch_pages: int
    ) -> None:
        self.worker = BackupWorker(storage, plan, host_pool, batch_pages)
        self._closed = False
        self.worker.start()

    @property
    def turn(self) -> ReadsFirst:
        """What the backup thread yields to (the prefetch pipeline reports its reads)."""
        return self.worker.turn

    def submit(self, task: BackupTask) -> None:
        self.worker.turn.backlog(len(task.hashes))
        self.worker.inbox.put(task)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold backups between batches while the caller computes (a prefill): they are
        background work, and on a small host they would take cores from the forward pass."""
        self.worker.open.clear()
        try:
            yield
        finally:
            self.worker.open.set()

    def close(self) -> None:
        """Stop the thread after the tasks queued so far; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.worker.open.set()
        self.worker.turn.close()
        self.worker.inbox.put(None)
        self.worker.join()
