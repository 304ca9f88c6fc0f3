"""The vLLM connector's scheduler side without vLLM: what to load and save each step.

:class:`PagePlanner` looks a request's whole pages up in the store (leading pages past
what vLLM already holds), remembers the load vLLM allocated blocks for, and each step turns
the scheduler's output into :class:`StepPlan`: the loads of requests scheduled this step
and the saves of pages that this step's forward fills. The worker side is
:class:`~hicache_ray.integrations.vllm.blocks.BlockMover`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from hicache_ray.base.stats import ConnectorStats
from hicache_ray.keys import page_hashes
from hicache_ray.storage import StorageBackend

__all__ = ["PageJob", "PagePlanner", "SaveAcks", "StepPlan"]


class PageJob(msgspec.Struct, frozen=True):
    """Pages of one request to move: their hashes and vLLM block ids, in page order."""

    req_id: str
    hashes: list[str]
    block_ids: list[int]


class StepPlan(msgspec.Struct):
    """The scheduler's word to the workers for one step (vLLM's connector metadata)."""

    loads: list[PageJob] = msgspec.field(default_factory=list)
    saves: list[PageJob] = msgspec.field(default_factory=list)
    async_loads: bool = False  # loads run behind the step; vLLM waits for get_finished


@dataclass
class _Request:
    hashes: list[str]  # of the tokens known so far, whole pages
    salt: str  # the chain's tenant salt
    hit_pages: int = 0  # leading pages present (local hit included)
    local_pages: int = 0  # pages vLLM held itself at the lookup
    looked_up: bool = False  # vLLM asks again while the request waits: answered once
    saved_pages: int = 0  # pages known stored or handed to a save
    load: PageJob | None = None  # allocated, not yet handed to the workers


class PagePlanner:
    """Scheduler-side state of the connector (one per vLLM scheduler).

    Args:
        backend: the store (lookups only).
        keys_per_page: the object suffixes of one page for every TP rank (a page is a hit
            only when every rank's objects are stored).
        page_size: tokens per page (vLLM's block size).
        salt: the tenant salt of requests that carry none.
        load_async: loads run behind the steps (vLLM waits for them), not before the
            forward that needs them.
    """

    def __init__(
        self,
        backend: StorageBackend,
        suffixes: Sequence[str],
        page_size: int,
        salt: str,
        *,
        load_async: bool = False,
    ) -> None:
        self._backend = backend
        self._suffixes = list(suffixes)
        self._page_size = page_size
        self._salt = salt
        self._requests: dict[str, _Request] = {}
        self._allocated: list[str] = []  # requests whose load is not planned yet
        self.load_async = load_async
        self.counts = ConnectorStats()

    def lookup(self, req_id: str, tokens: Sequence[int], num_computed: int, salt: str) -> int:
        """Tokens past ``num_computed`` the store can supply (leading whole pages, leaving
        the prompt's last token to compute); remembers the hashes and the answer for the
        request (vLLM asks again each step the request waits for room)."""
        p = self._page_size
        state = self._requests.get(req_id)
        if state is None:
            salt = salt or self._salt
            state = _Request(page_hashes(list(tokens), p, salt=salt or None), salt)
            self._requests[req_id] = state
        usable = (len(tokens) - 1) // p
        start = num_computed // p
        if state.looked_up and state.local_pages == start:  # no store round trip again
            return (state.hit_pages - start) * p
        found = start
        batch = 64
        while found < usable:
            chunk = state.hashes[found : min(found + batch, usable)]
            keys = [f"{h}_{s}" for h in chunk for s in self._suffixes]
            present = self._backend.exists(keys) // len(self._suffixes)
            found += present
            if present < len(chunk):
                break
        state.local_pages, state.hit_pages = start, max(found, start)
        state.looked_up = True
        state.saved_pages = max(state.saved_pages, state.hit_pages)
        return (state.hit_pages - start) * p

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated the request's blocks; ``num_external`` tokens are to be loaded."""
        state = self._requests.get(req_id)
        if state is None or num_external <= 0:
            return
        first = state.local_pages
        pages = num_external // self._page_size
        job = PageJob(
            req_id,
            state.hashes[first : first + pages],
            list(block_ids[first : first + pages]),
        )
        state.load = job
        state.looked_up = False  # the answer is taken: a later ask (after a failed load) is new
        self._allocated.append(req_id)
        self.counts.hit_tokens += num_external

    def step(self, scheduled: Sequence[tuple[str, int, Sequence[int], Sequence[int]]]) -> StepPlan:
        """The plan of one step. ``scheduled``: per scheduled request, its id, the tokens
        whose KV exists after this step, all its token ids, and its block ids."""
        plan = StepPlan(async_loads=self.load_async)
        for req_id in self._allocated:  # asynchronous loads: the request is not scheduled
            state = self._requests.get(req_id)
            if state is not None and state.load is not None:
                plan.loads.append(state.load)
                state.load = None
        self._allocated = []
        p = self._page_size
        for req_id, computed, tokens, block_ids in scheduled:
            state = self._requests.get(req_id)
            if state is None:
                continue
            full = min(computed, len(tokens)) // p
            if full <= state.saved_pages:
                continue
            if len(state.hashes) < full:
                prior = bytes.fromhex(state.hashes[-1]) if state.hashes else b""
                more = tokens[len(state.hashes) * p : full * p]
                if prior:
                    state.hashes += page_hashes(list(more), p, prior=prior)
                else:  # the request had no whole page at its lookup
                    state.hashes = page_hashes(list(tokens[: full * p]), p, salt=state.salt or None)
            first = state.saved_pages
            plan.saves.append(
                PageJob(req_id, state.hashes[first:full], list(block_ids[first:full]))
            )
            state.saved_pages = full
        return plan

    def finished(self, req_id: str) -> None:
        """Forget the request (finished, aborted or dropped by vLLM)."""
        self._requests.pop(req_id, None)

    @property
    def tracked(self) -> int:
        return len(self._requests)


class SaveAcks:
    """Which saved pages every worker has stored its objects of (scheduler side).

    Each TP worker stores its own objects of a page, on its own writer thread, and reports
    the pages it finished after a later step (:meth:`HiCacheRayConnector.
    get_kv_connector_kv_cache_events`); a page is in the store once all ``workers`` have
    reported it. Pages still waiting for a worker are kept for the last ``keep`` pages
    reported (a worker whose save failed never reports: its page is dropped from here).
    """

    def __init__(self, workers: int, keep: int = 1 << 16) -> None:
        self._workers, self._keep = workers, keep
        self._waiting: OrderedDict[str, int] = OrderedDict()

    def add(self, pages: Sequence[str]) -> list[str]:
        """Count the workers' reports ``pages``; returns the pages now stored by all."""
        done = []
        waiting = self._waiting
        for page in pages:
            count = waiting.pop(page, 0) + 1
            if count >= self._workers:
                done.append(page)
            else:
                waiting[page] = count
        while len(waiting) > self._keep:
            waiting.popitem(last=False)
        return done
