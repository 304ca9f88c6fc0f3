"""Acknowledgements of host writes and L3 backups, agreed across ranks.

Each rank counts the writes and backups it has completed, in submission order; the step's
MIN makes the count every rank has reached, and only those are acknowledged. A backup that
failed on any rank is acknowledged as failed on every rank (the agreed first failure), so
every rank's tree marks the same nodes as stored. Acknowledged writes feed the backup
pipeline in the same order on every rank.
"""

from __future__ import annotations

from hicache_ray.base.stats import ControllerStats
from hicache_ray.cache.controller.backup import BackupPipeline, BackupTask
from hicache_ray.cache.controller.failure import Failure
from hicache_ray.cache.hicache import HiCache
from hicache_ray.cache.tree import BackupMark, TreeNode, node_page_hashes
from hicache_ray.keys.tenant import owner_of

__all__ = ["NO_FAILURE", "Acknowledger"]

NO_FAILURE = 1 << 62  # "no failed backup" in the MIN of first failures


class Acknowledger:
    """Turns agreed counts into acknowledged writes and backups on one rank."""

    def __init__(
        self, cache: HiCache, backup: BackupPipeline | None, stats: ControllerStats
    ) -> None:
        self._cache = cache
        self._backup = backup
        self._stats = stats
        self._writes_acked = 0
        self._backups: list[BackupTask] = []  # submitted, not acknowledged; FIFO
        self._backups_acked = 0  # sequence number of _backups[0]

    # ------------------------------------------------------------------ facts

    def facts(self) -> list[int]:
        """[completed writes, completed backups, first failed backup] (cumulative counts)."""
        done = 0
        first_failed = NO_FAILURE
        for task in self._backups:
            if not task.done:
                break
            if task.failure is not None and first_failed == NO_FAILURE:
                first_failed = self._backups_acked + done
            done += 1
        return [self._cache.num_completed_writes, self._backups_acked + done, first_failed]

    @property
    def pending_backups(self) -> int:
        return len(self._backups)

    @property
    def pending_backup_pages(self) -> int:
        """L2 pages that submitted backups have yet to store (and hold locked until then)."""
        return sum(len(t.hashes) - t.stored_pages for t in self._backups if not t.done)

    def wait_backups(self, timeout: float | None = None) -> None:
        """Block until every submitted backup has run (local; no collective)."""
        for task in list(self._backups):
            task.finished.wait(timeout)

    # ---------------------------------------------------------------- agreed

    def apply(self, writes: int, backups: int, first_failed: int) -> None:
        """Acknowledge what every rank has completed (the agreed values of :meth:`facts`)."""
        end = min(backups, first_failed)
        while self._backups and self._backups_acked < end:
            self._ack_backup(self._backups.pop(0), ok=True)
            self._backups_acked += 1
        if first_failed < backups and self._backups and self._backups_acked == first_failed:
            self._ack_backup(self._backups.pop(0), ok=False)
            self._backups_acked += 1
        new = writes - self._writes_acked
        if new <= 0:
            return
        acked = self._cache.take_completed_writes(new)
        self._writes_acked += len(acked)
        for nodes, ok in acked:
            if ok and self._backup is not None:
                for node in nodes:
                    self._submit_backup(node)

    def _submit_backup(self, node: TreeNode) -> None:
        """Back up ``node`` after any ancestors not backed up yet (parents first).

        An ancestor without a backup is usually a piece of the same write that a later
        match split off. One without a completed host copy (under write_back, a parent still
        only on the device) is a gap: the node waits, and is backed up once that ancestor's
        own backup succeeds. An ancestor whose backup failed (a store outage) is tried
        again, so backups resume with the writes that follow once the store is back; every
        rank decides this from the same acknowledged writes.
        """
        tree = self._cache.tree
        retry = (None, BackupMark.WAITING, BackupMark.FAILED)
        if node.host_pages is None or node.backup not in retry or node.parent is None:
            return
        chain = []
        ancestor = node
        while not ancestor.is_root and ancestor.backup in retry:
            if not ancestor.backed_up:
                node.backup = BackupMark.WAITING
                self._stats.backup_skipped_gap += 1
                return
            chain.append(ancestor)
            assert ancestor.parent is not None
            ancestor = ancestor.parent
        parent_task = None if ancestor.is_root else ancestor.backup
        assert parent_task is None or isinstance(parent_task, BackupTask)
        owner = owner_of(tree.roots.salt_of_node(node))
        for n in reversed(chain):
            task = BackupTask(n, self._hashes(n), list(n.host_pages or ()), parent_task, owner)
            n.backup = task
            # Its host slots stay put until the backup is acknowledged; its device pages
            # may be evicted meanwhile (they are not what the backup reads).
            tree.lock(n, host_only=True)
            self._backups.append(task)
            assert self._backup is not None
            self._backup.submit(task)
            parent_task = task

    def _ack_backup(self, task: BackupTask, *, ok: bool) -> None:
        node = task.node
        self._cache.tree.unlock(node, host_only=True)
        if ok:
            self._stats.backed_up_pages += len(task.hashes)
            self._stats.backup_bytes += task.num_bytes
            self._cache.tree.observer.backed_up(node)
            for child in list(node.children.values()):
                if child.backup == BackupMark.WAITING:  # its gap just closed
                    child.backup = None
                    self._submit_backup(child)
            return
        if task.failure is Failure.PARENT_NOT_STORED:
            self._stats.backup_skipped_gap += 1
        else:
            self._stats.backup_failures += 1
        if node.backup is task:
            node.backup = BackupMark.FAILED  # its descendants will not be stored: no holes

    def _hashes(self, node: TreeNode) -> list[str]:
        """Page hashes of ``node`` (chained from the root), cached on the nodes."""
        cache = self._cache
        return node_page_hashes(node, cache.page_size, cache.tree.roots.salt_of)
