"""Prefix claims: an admitted request between admission and ``take``, its facts, agreements
and prefetch.

Each request contributes four integers to the step vector, all in pages of its prompt:

* ``ready``: leading pages this rank holds in L1/L2 (matched at admission, plus pages read
  from L3 so far);
* ``total``: leading pages available from L1/L2/L3 here, -1 while the storage query runs;
* ``finished``: 1 when this rank expects no more progress (query done and nothing to read,
  or reading done), else 0;
* ``-timed_out``: the ``timeout`` policy's deadline passed on this rank (negated: any rank).

After the MIN, an agreed ``total`` starts this rank's reads of ``[ready, total)`` into host
slots; the agreed ``ready`` is what ``take`` hands to the request, the same on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hicache_ray.base.config import CacheConfig
from hicache_ray.base.errors import HiCacheError
from hicache_ray.base.stats import ControllerStats, Unfulfilled
from hicache_ray.base.tokens import TOKEN_BYTES, encode_tokens
from hicache_ray.cache.controller.backup import BackupTask
from hicache_ray.cache.controller.claim import FACTS, Facts, PrefixClaim
from hicache_ray.cache.controller.cost import CostModel
from hicache_ray.cache.controller.failure import Failure
from hicache_ray.cache.controller.fetch_task import FetchTask
from hicache_ray.cache.controller.protocol import ArrivalLike
from hicache_ray.cache.handle import CacheHandle
from hicache_ray.cache.hicache import HiCache
from hicache_ray.cache.tree.peek import cached_pages

if TYPE_CHECKING:
    from hicache_ray.cache.controller.prefetch import PrefetchPipeline

__all__ = ["Claims", "PrefixClaim"]  # PrefixClaim: defined in .claim


class Claims:
    """Makes, agrees, hands over and drops the prefix claims of one rank's requests.

    It holds no request: only the L3 tasks of the claims not yet taken and the host slots
    they hold (what :meth:`wait` and the pool accounting need).
    """

    def __init__(
        self,
        cache: HiCache,
        config: CacheConfig,
        prefetch: PrefetchPipeline | None,
        stats: ControllerStats,
        note_failure: Callable[[], None],
        clock: Callable[[], float],
    ) -> None:
        self._cache = cache
        self._config = config
        self._prefetch = prefetch
        self._stats = stats
        self._note_failure = note_failure
        self._clock = clock
        self._tasks: set[FetchTask] = set()  # the prefetches of claims not yet taken
        self.prefetch_host_pages = 0  # host slots held by prefetch tasks
        self._page_size = config.page_size
        self._quota = int(config.prefetch.max_host_fraction * cache.host_pool.num_pages)
        self.cost = CostModel()  # this rank's compute and L3 read rates
        prefetch_cfg = config.prefetch
        self._guarded = prefetch_cfg.recompute_guard and prefetch_cfg.policy == "timeout"

    @property
    def num_fetching(self) -> int:
        """Claims with an L3 prefetch, not taken yet."""
        return len(self._tasks)

    @property
    def local_work(self) -> bool:
        """An L3 query or read of a claim not taken yet is running on this rank (its end
        wakes the step loop); when none is, the claims wait on the agreement alone."""
        return any(
            not t.queried.is_set() or (t.read_started and not t.read_finished.is_set())
            for t in self._tasks
        )

    # ----------------------------------------------------------------- facts

    def facts(self, claims: Sequence[PrefixClaim]) -> list[int]:
        """This rank's facts of ``claims``, ``FACTS`` each, in order."""
        now = self._clock()
        out: list[int] = []
        for c in claims:
            out += c.final or self._facts_of(c, now)
        return out

    @staticmethod
    def _facts_of(c: PrefixClaim, now: float) -> Facts:
        t = c.task
        timed_out = -int(now >= c.deadline)
        if t is None:
            facts = Facts(c.cached, c.cached, 1, timed_out)
        else:  # an eager task's reads start only once it is queried
            done = t.queried.is_set() and t.settled
            finished = done if c.fetch_started else 0 <= t.local_total <= c.cached
            facts = Facts(t.pages_read, t.local_total, int(finished), timed_out)
        if facts.finished and (timed_out or c.deadline == math.inf):
            c.final = facts  # nothing left to change: skip the work on later steps
        return facts

    def apply(
        self, claims: Sequence[PrefixClaim], agreed: Sequence[int], *, on_arrival: bool = False
    ) -> None:
        """Take the agreed facts of ``claims``, in :meth:`facts` order (``on_arrival``: the
        extra round of the step that admitted them)."""
        for i, c in enumerate(claims):
            c.agreed = Facts(*agreed[i * FACTS : (i + 1) * FACTS])
            c.agreed_on_arrival = on_arrival
            if c.task is None:
                continue
            if c.agreed.total >= 0 and not c.fetch_started:
                self._start_fetch(c, c.agreed.total)
            if c.agreed.finished and self._prefetch is not None:
                self._prefetch.give_up(c.task)  # every rank's reads are done

    # ------------------------------------------------------------ admission

    def admit(self, arrival: ArrivalLike) -> PrefixClaim:
        """Lock the longest prefix of ``arrival`` cached here and start its L3 query."""
        ps = self._page_size
        tree = self._cache.tree
        key = encode_tokens(arrival.tokens)
        whole = len(arrival.tokens) // ps
        m = tree.match_prefix(key, salt=arrival.cache_salt, count_hit=False)
        tree.lock(m.best_match_node)
        cached = len(m.device_pages) + m.host_hit_pages
        c = PrefixClaim(arrival, key, whole * ps * TOKEN_BYTES, m.best_match_node, cached)
        c.admitted_at = self._clock()
        prefetch = self._config.prefetch
        if self._prefetch is not None and self._would_query(
            len(arrival.tokens), cached, count=True
        ):
            salt = arrival.cache_salt or self._config.storage.tenant_salt
            c.task = FetchTask(c.key, whole, cached, salt)
            self._tasks.add(c.task)
            if prefetch.eager_reads:
                self._reserve(c)
            self._prefetch.submit_query(c.task)
            if prefetch.policy == "timeout":
                wait_s = prefetch.timeout_s((whole - cached) * ps)
                if self._guarded:
                    wait_s = self.cost.wait_s((whole - cached) * ps, wait_s)
                c.deadline = c.admitted_at + wait_s
        self._stats.requests += 1
        return c

    def look_ahead_start(self, key: bytes, cache_salt: str) -> int:
        """On the step thread, for a prompt (``key``: its encoded tokens) this rank is about
        to admit (rank 0's arrival, before its admission step): the first page past those
        cached here (what a peer is told, its tree being the same) when
        :meth:`look_ahead_from` it would look the prompt up, else -1. Changes nothing."""
        if self._prefetch is None or self._tasks:
            return -1
        cached = cached_pages(self._cache.tree, key, cache_salt)
        return cached if self._would_query(len(key) // TOKEN_BYTES, cached) else -1

    def look_ahead(self, key: bytes, cache_salt: str) -> int:
        """:meth:`look_ahead_start`, then :meth:`look_ahead_from` that page; the page, or
        -1 if no lookup was queued."""
        start = self.look_ahead_start(key, cache_salt)
        return start if start >= 0 and self.look_ahead_from(key, cache_salt, start) else -1

    def look_ahead_from(
        self, key: bytes, cache_salt: str, start: int, *, here: bool = False
    ) -> bool:
        """Look up in L3 now the pages from ``start`` of a prompt (``key``: its encoded
        tokens) about to be admitted, so that its query at admission finds the answers
        (and where the objects are) in the store client and asks the store nothing. Only
        when the query at admission would be made and no other prefetch is pending here
        (under load, look-aheads would queue ahead of admitted requests' queries). Any
        thread (it reads no tree); ``here``: the lookup runs on it, not on the query
        thread (:meth:`PrefetchPipeline.look_ahead`). Whether a lookup was made or queued.
        It reads nothing."""
        tokens = len(key) // TOKEN_BYTES
        if self._prefetch is None or self._tasks or not self._would_query(tokens, start):
            return False
        salt = cache_salt or self._config.storage.tenant_salt
        self._stats.prefetch_lookaheads += 1  # one thread a rank: the step's, or the peer's
        task = FetchTask(key, tokens // self._page_size, start, salt)
        self._prefetch.look_ahead(task, here=here)
        return True

    def _would_query(self, tokens: int, cached: int, *, count: bool = False) -> bool:
        """Whether admission queries L3 for a prompt of ``tokens`` tokens with ``cached``
        pages held here: whole pages past them, at least the threshold's tokens past them,
        and a lookup that pays by the guard's rates (a skipped one counted with ``count``)."""
        ps = self._page_size
        pages = tokens // ps - cached
        if pages <= 0:
            return False
        if tokens - cached * ps < self._config.prefetch.threshold_tokens:
            return False
        if not self._guarded or self.cost.worth_querying(pages, pages * ps):
            return True
        if count:
            self._stats.prefetch_queries_skipped += 1
        return False

    def _reserve(self, c: PrefixClaim) -> None:
        """Make ``c``'s task eager: host slots for every page past its hit, when that many
        are free within the prefetch quota (none is evicted for a query that may miss) and
        worth reading; otherwise its reads wait for the agreed count (``_start_fetch``)."""
        task = c.task
        assert task is not None
        want, alloc = task.num_pages - c.cached, self._cache.host_pool.allocator
        if self._quota_room(want) < want or want > alloc.num_free_pages:
            return
        if self._guarded and not self.cost.worth_reading(want, want * self._page_size):
            return  # _start_fetch skips it again, and counts it
        pages = alloc.allocate(want)
        if pages is None:
            return
        task.host_pages, task.read_end, task.eager = pages, c.cached + want, True
        self.prefetch_host_pages += want
        c.fetch_started = True

    def _quota_room(self, need: int) -> int:
        """How many of ``need`` host slots running prefetches may still hold."""
        if self._config.prefetch.max_host_fraction >= 1:
            return need
        return min(need, max(0, self._quota - self.prefetch_host_pages))

    def _start_fetch(self, c: PrefixClaim, total: int) -> None:
        task, pipeline = c.task, self._prefetch
        assert task is not None and pipeline is not None
        c.fetch_started = True
        unfulfilled = self._stats.unfulfilled_tokens
        if task.local_total > total:
            unfulfilled[Unfulfilled.PEER_MISS] += (task.local_total - total) * self._page_size
        need = total - c.cached
        if need <= 0:
            return
        allowed = self._quota_room(need)
        unfulfilled[Unfulfilled.PREFETCH_QUOTA] += (need - allowed) * self._page_size
        if self._guarded and not self.cost.worth_reading(allowed, allowed * self._page_size):
            unfulfilled[Unfulfilled.SLOWER_THAN_COMPUTE] += allowed * self._page_size
            allowed = 0
        pages = self._cache.alloc_host(allowed) if allowed else []
        if pages is None:
            alloc = self._cache.host_pool.allocator
            pages = alloc.allocate(min(allowed, alloc.num_free_pages)) or []
        unfulfilled[Unfulfilled.HOST_CAPACITY] += (allowed - len(pages)) * self._page_size
        task.host_pages = pages
        task.read_start = c.cached
        task.read_end = c.cached + len(pages)
        self.prefetch_host_pages += len(pages)
        if pages:
            pipeline.submit_read(task)

    # ------------------------------------------------------------ hand-over

    def take(self, c: PrefixClaim, max_pages: int | None) -> CacheHandle:
        """Lock and start loading the agreed prefix of ``c`` (at most ``max_pages`` pages)."""
        if c.agreed is None:
            raise HiCacheError(f"request {c.rid!r} has no agreed prefix yet; take runnable ones")
        self._end(c)
        cache, tree, salt = self._cache, self._cache.tree, c.arrival.cache_salt
        ready = c.agreed.ready if max_pages is None else min(c.agreed.ready, max_pages)
        useful = self._finish_task(c, ready, count=True)
        dropped = None
        if useful:
            assert c.task is not None
            unbacked = not c.node.is_root and not c.node.backed_up
            if self._config.write.policy == "write_through" and unbacked:
                dropped = useful  # the host tier must stay a superset of the device tier
                self._stats.refills_dropped += 1
            else:
                result = tree.insert_host(c.key, c.task.read_start, useful, salt=salt)
                cache.host_pool.allocator.free(result.duplicate_pages)
                for node in result.new_nodes + result.adopted_nodes:
                    node.backup = BackupTask.already_stored(node)  # children may be stored
            self._stats.storage_hit_tokens += len(useful) * self._page_size
        handle = cache.match(c.key, limit_pages=ready, extra_host_pages=dropped, salt=salt)
        handle.prompt_key = c.prompt_key
        handle.storage_hit_tokens = len(useful) * self._page_size
        tree.unlock(c.node)
        if handle.num_cached_tokens < ready * self._page_size:
            self._note_failure()  # this rank's device pool could not hold the agreed prefix
        return handle

    def cancel(self, c: PrefixClaim) -> None:
        """Drop ``c`` without running its request: unlock it, stop and free its prefetch."""
        self._end(c)
        self._finish_task(c, 0, count=False)
        self._cache.tree.unlock(c.node)

    def wait_queries(self, claims: Sequence[PrefixClaim], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` in all for the L3 queries of ``claims`` (a query that
        ends in time is agreed in this step; a slow or dead store only costs the wait)."""
        deadline = self._clock() + timeout_s
        for c in claims:
            if c.task is not None:
                c.task.queried.wait(max(0.0, deadline - self._clock()))

    def wait_local(self, claims: Sequence[PrefixClaim], limit_s: float) -> None:
        """Wait up to ``limit_s`` in all, and not past the earliest prefetch deadline of
        ``claims``, for the queries and started reads of every claim not taken yet."""
        left = min([limit_s, *(c.deadline - self._clock() for c in claims)])
        end = time.monotonic() + max(0.0, left)
        for task in list(self._tasks):
            if not task.queried.wait(max(0.0, end - time.monotonic())):
                return
            if task.read_started and not task.read_finished.wait(max(0.0, end - time.monotonic())):
                return

    def wait(self, timeout: float | None) -> None:
        """Wait (locally) for the queries and reads of every claim not taken yet."""
        for task in list(self._tasks):
            task.queried.wait(timeout)
            if task.read_started:
                task.read_finished.wait(timeout)

    def close(self) -> None:
        """Stop every prefetch not taken yet (the pipelines are closing)."""
        for task in self._tasks:
            task.cancelled = True
        self._tasks.clear()

    def _end(self, c: PrefixClaim) -> None:
        if c.done:
            raise HiCacheError(f"request {c.rid!r} was already taken or cancelled")
        c.done = True
        if c.task is not None:
            self._tasks.discard(c.task)

    def _finish_task(self, c: PrefixClaim, ready: int, *, count: bool) -> list[int]:
        """Stop ``c``'s prefetch; return its slots holding pages below ``ready``, free the
        rest behind the task (the read thread may still be writing them)."""
        task = c.task
        if task is None:
            return []
        task.cancelled = True
        if self._prefetch is not None:  # a read that runs on for nobody holds no backup
            self._prefetch.give_up(task)
        keep = max(0, ready - task.read_start) if c.fetch_started else 0
        useful, rest = task.host_pages[:keep], task.host_pages[keep:]
        self._cache.host_pool.allocator.free(rest, fence=task)
        self.prefetch_host_pages -= len(task.host_pages)
        if count:
            self._count(c, ready)
        return useful

    def _count(self, c: PrefixClaim, ready: int) -> None:
        task, stats, ps = c.task, self._stats, self._page_size
        assert task is not None
        read = task.pages_read - task.read_start
        if task.read_started and task.failure is None:  # a cut read counts as slow as it was
            ended = task.read_done_at or time.perf_counter()  # the task's own clock
            self.cost.note_read(max(1, read), ended - task.read_started_at)
        stats.prefetched_pages += read
        stats.prefetched_bytes += read * self._cache.kv.page_bytes
        stats.prefetch_latency_s += self._clock() - c.admitted_at
        if task.failure is Failure.QUERY_FAILED:
            stats.prefetch_query_failures += 1
        elif task.queried_at:
            self.cost.note_query(task.queried_at - task.created_at)
        if c.agreed is None:
            return
        if task.eager and 0 <= c.agreed.total < task.local_total:  # what a peer lacks
            missed = task.local_total - max(c.agreed.total, task.start_page)
            stats.unfulfilled_tokens[Unfulfilled.PEER_MISS] += missed * ps
        if c.agreed.total <= ready:
            return
        missing = (c.agreed.total - ready) * ps
        if c.agreed.finished != 1:
            stats.unfulfilled_tokens[Unfulfilled.TERMINATED] += missing
        elif task.failure is not None:
            stats.unfulfilled_tokens[Unfulfilled.READ_FAILED] += missing
        elif task.read_end >= c.agreed.total:
            stats.unfulfilled_tokens[Unfulfilled.PEER_MISS] += missing
