"""Admitted requests between admission and ``take``: their facts, agreements and prefetch.

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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from hicache_ray.cache import CacheHandle, HiCache
from hicache_ray.config import CacheConfig
from hicache_ray.controller.backup import BackupTask
from hicache_ray.controller.prefetch import FetchTask
from hicache_ray.controller.protocol import Arrival
from hicache_ray.errors import HiCacheError
from hicache_ray.stats import ControllerStats
from hicache_ray.tree import TreeNode
from hicache_ray.tree.tokens import TOKEN_BYTES, encode_tokens

if TYPE_CHECKING:
    from hicache_ray.controller.prefetch import PrefetchPipeline

__all__ = ["RequestState"]


class Facts(NamedTuple):
    """One request's facts in the step vector, in this order (MIN-agreed across ranks).

    Attributes:
        ready: leading pages in L1/L2 here (read from L3 included).
        total: leading pages in L1/L2/L3 here; -1 while the storage query runs.
        finished: 1 when this rank's reads are done (the MIN: every rank's).
        timed_out: -1 when the prefetch deadline passed (negated: the MIN is "any rank").
    """

    ready: int
    total: int
    finished: int
    timed_out: int


FACTS = len(Facts._fields)  # integers per request in the step vector


class _Request:
    __slots__ = (
        "admitted_at",
        "agreed",
        "agreed_on_arrival",
        "arrival",
        "cached",
        "deadline",
        "fetch_started",
        "final",
        "key",
        "node",
        "prompt_key",
        "task",
    )

    def __init__(
        self, arrival: Arrival, prompt_key: bytes, whole_bytes: int, node: TreeNode, cached: int
    ) -> None:
        self.arrival = arrival
        self.prompt_key = prompt_key  # the prompt encoded once, reused at take and finish
        self.key = prompt_key[:whole_bytes]  # its whole pages
        self.node = node  # locked from admission to take
        self.cached = cached
        self.task: FetchTask | None = None
        self.agreed: Facts | None = None
        self.agreed_on_arrival = False  # only the admitting step's round has agreed yet
        self.fetch_started = False
        self.final: Facts | None = None  # facts that can no longer change
        self.admitted_at = 0.0
        self.deadline = math.inf


class RequestState:
    """The admitted requests of one rank, in admission (= agreed) order."""

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
        self._requests: dict[str, _Request] = {}
        self._runnable: list[str] | None = None  # valid until the agreements or the set change
        self.prefetch_host_pages = 0  # host slots held by prefetch tasks
        page_size = config.page_size
        self._page_size = page_size
        self._quota = int(config.prefetch.max_host_fraction * cache.host_pool.num_pages)

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def known(self) -> dict[str, _Request]:
        return self._requests

    @property
    def num_fetching(self) -> int:
        return sum(1 for r in self._requests.values() if r.task is not None)

    # ----------------------------------------------------------------- facts

    def facts(self, rids: Sequence[str] | None = None) -> list[int]:
        """This rank's facts of every request (or of ``rids``), ``FACTS`` each, in order."""
        now = self._clock()
        out: list[int] = []
        chosen = self._requests.values() if rids is None else [self._requests[r] for r in rids]
        for r in chosen:
            out += r.final or self._facts_of(r, now)
        return out

    @staticmethod
    def _facts_of(r: _Request, now: float) -> Facts:
        t = r.task
        timed_out = -int(now >= r.deadline)
        if t is None:
            facts = Facts(r.cached, r.cached, 1, timed_out)
        else:
            finished = t.settled if r.fetch_started else 0 <= t.local_total <= r.cached
            facts = Facts(t.pages_read, t.local_total, int(finished), timed_out)
        if facts.finished and (timed_out or r.deadline == math.inf):
            r.final = facts  # nothing left to change: skip the work on later steps
        return facts

    def apply(self, agreed: Sequence[int], rids: Sequence[str] | None = None) -> None:
        """Take the agreed facts of every request (or of ``rids``), in :meth:`facts` order."""
        self._runnable = None
        chosen = self._requests.values() if rids is None else [self._requests[r] for r in rids]
        for i, r in enumerate(chosen):
            r.agreed = Facts(*agreed[i * FACTS : (i + 1) * FACTS])
            r.agreed_on_arrival = rids is not None
            if r.agreed.total >= 0 and r.task is not None and not r.fetch_started:
                self._start_fetch(r, r.agreed.total)

    def runnable(self) -> list[str]:
        if self._runnable is not None:
            return list(self._runnable)
        policy = self._config.prefetch.policy
        out = []
        for rid, r in self._requests.items():
            if r.agreed is None:
                continue
            facts = r.agreed
            timed_out = policy == "timeout" and facts.timed_out < 0
            # best_effort gives a query one step (as long as a forward) before it gives up
            effort = policy == "best_effort" and not r.agreed_on_arrival
            if effort or facts.finished == 1 or timed_out:
                out.append(rid)
        self._runnable = out
        return list(out)

    def agreed_ready(self, rid: str) -> int:
        r = self._requests.get(rid)
        return -1 if r is None or r.agreed is None else r.agreed.ready

    # ------------------------------------------------------------ admission

    def admit(self, arrival: Arrival) -> None:
        ps = self._page_size
        tree = self._cache.tree
        key = encode_tokens(arrival.tokens)
        whole = len(arrival.tokens) // ps
        m = tree.match_prefix(key, count_hit=False)
        tree.lock(m.best_match_node)
        cached = len(m.device_pages) + m.host_hit_pages
        r = _Request(arrival, key, whole * ps * TOKEN_BYTES, m.best_match_node, cached)
        r.admitted_at = self._clock()
        prefetch = self._config.prefetch
        past = len(arrival.tokens) - cached * ps
        if self._prefetch is not None and whole > cached and past >= prefetch.threshold_tokens:
            r.task = FetchTask(r.key, whole, cached, self._config.storage.tenant_salt)
            self._prefetch.submit_query(r.task)
            if prefetch.policy == "timeout":
                r.deadline = r.admitted_at + prefetch.timeout_s((whole - cached) * ps)
        self._requests[arrival.rid] = r
        self._runnable = None
        self._stats.requests += 1

    def _start_fetch(self, r: _Request, total: int) -> None:
        task, pipeline = r.task, self._prefetch
        assert task is not None and pipeline is not None
        r.fetch_started = True
        unfulfilled = self._stats.unfulfilled_tokens
        if task.local_total > total:
            unfulfilled["peer_miss"] += (task.local_total - total) * self._page_size
        need = total - r.cached
        if need <= 0:
            return
        allowed = need
        if self._config.prefetch.max_host_fraction < 1:
            allowed = min(need, max(0, self._quota - self.prefetch_host_pages))
        unfulfilled["prefetch_quota"] += (need - allowed) * self._page_size
        pages = self._cache.alloc_host(allowed)
        if pages is None:
            alloc = self._cache.host_pool.allocator
            pages = alloc.allocate(min(allowed, alloc.num_free_pages)) or []
        unfulfilled["host_capacity"] += (allowed - len(pages)) * self._page_size
        task.host_pages = pages
        task.read_start = r.cached
        task.read_end = r.cached + len(pages)
        self.prefetch_host_pages += len(pages)
        if pages:
            pipeline.submit_read(task)

    # ------------------------------------------------------------ hand-over

    def take(self, rid: str, max_pages: int | None) -> CacheHandle:
        if rid in self._requests and self._requests[rid].agreed is None:
            raise HiCacheError(f"request {rid!r} has no agreed prefix yet; take runnable ones")
        r = self._pop(rid)
        assert r.agreed is not None
        cache, tree = self._cache, self._cache.tree
        ready = r.agreed.ready if max_pages is None else min(r.agreed.ready, max_pages)
        useful = self._finish_task(r, ready, count=True)
        dropped = None
        if useful:
            assert r.task is not None
            unbacked = r.node is not tree.root and not r.node.backed_up
            if self._config.write.policy == "write_through" and unbacked:
                dropped = useful  # the host tier must stay a superset of the device tier
                self._stats.refills_dropped += 1
            else:
                result = tree.insert_host(r.key, r.task.read_start, useful)
                cache.host_pool.allocator.free(result.duplicate_pages)
                for node in result.new_nodes + result.adopted_nodes:
                    node.backup = BackupTask.already_stored(node)  # children may be stored
            self._stats.storage_hit_tokens += len(useful) * self._page_size
        handle = cache.match(r.key, limit_pages=ready, extra_host_pages=dropped)
        handle.prompt_key = r.prompt_key
        handle.storage_hit_tokens = len(useful) * self._page_size
        tree.unlock(r.node)
        if handle.num_cached_tokens < ready * self._page_size:
            self._note_failure()  # this rank's device pool could not hold the agreed prefix
        return handle

    def cancel(self, rid: str) -> None:
        r = self._pop(rid)
        self._finish_task(r, 0, count=False)
        self._cache.tree.unlock(r.node)

    def cancel_all(self) -> None:
        for rid in list(self._requests):
            self.cancel(rid)

    def wait_queries(self, rids: Sequence[str], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` in all for the L3 queries of ``rids`` (a query that
        ends in time is agreed in this step; a slow or dead store only costs the wait)."""
        deadline = self._clock() + timeout_s
        for rid in rids:
            task = self._requests[rid].task
            if task is not None:
                task.queried.wait(max(0.0, deadline - self._clock()))

    def wait(self, timeout: float | None) -> None:
        for r in self._requests.values():
            if r.task is not None:
                r.task.queried.wait(timeout)
                if r.task.read_started:
                    r.task.read_finished.wait(timeout)

    def _pop(self, rid: str) -> _Request:
        self._runnable = None
        try:
            return self._requests.pop(rid)
        except KeyError:
            raise HiCacheError(f"request {rid!r} is not admitted (or was taken)") from None

    def _finish_task(self, r: _Request, ready: int, *, count: bool) -> list[int]:
        """Stop ``r``'s prefetch; return its slots holding pages below ``ready``, free the
        rest behind the task (the read thread may still be writing them)."""
        task = r.task
        if task is None:
            return []
        task.cancelled = True
        keep = max(0, ready - task.read_start) if r.fetch_started else 0
        useful, rest = task.host_pages[:keep], task.host_pages[keep:]
        self._cache.host_pool.allocator.free(rest, fence=task)
        self.prefetch_host_pages -= len(task.host_pages)
        if count:
            self._count(r, ready)
        return useful

    def _count(self, r: _Request, ready: int) -> None:
        task, stats, ps = r.task, self._stats, self._page_size
        assert task is not None
        read = task.pages_read - task.read_start
        stats.prefetched_pages += read
        stats.prefetched_bytes += read * self._cache.kv.page_bytes
        stats.prefetch_latency_s += self._clock() - r.admitted_at
        if task.failure == "query_failed":
            stats.prefetch_query_failures += 1
        if r.agreed is None or r.agreed.total <= ready:
            return
        missing = (r.agreed.total - ready) * ps
        if r.agreed.finished != 1:
            stats.unfulfilled_tokens["terminated"] += missing
        elif task.failure is not None:
            stats.unfulfilled_tokens["read_failed"] += missing
        elif task.read_end >= r.agreed.total:
            stats.unfulfilled_tokens["peer_miss"] += missing
