"""Scheduling pieces of the runtime: the admission queue, running requests, batch planning.

Admission (rank 0 only; the others follow the arrivals it broadcasts). A request is
admitted into the controller (its prefetch starts) only when the device pool has room for
its whole footprint, ``ceil((prompt + max_new_tokens) / page_size)`` pages, next to the
footprints of every request admitted before it that has not finished; until then it waits
in a FIFO queue (oldest first: a request that does not fit holds back the ones behind it).
The sum of footprints bounds every device page a running or waiting request can lock (its
cached prefix, the pages it loads, the pages it reserves), so starting a request never runs
out of pages: unlocked pages are evicted, pages being written to L2 are waited for. Shared
prefixes are counted once per request, which is conservative. Only a request larger than
the whole pool (refused before this) or one past ``max_queued`` is turned away.

Batches (every rank, from agreed state): each step, every running request that finished its
prompt decodes one token; prefills, oldest first, get chunks of the remaining token budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from hicache_ray.cache import CacheHandle
from hicache_ray.memory import Transfer
from hicache_ray.model.transformer import Segment
from hicache_ray.request import FinishReason, GenerateRequest, RequestResult
from hicache_ray.sampling import RequestSampler

__all__ = ["Admission", "Req", "plan_batch"]


class Admission:
    """Rank 0's FIFO queue and device-pool budget (see the module docstring).

    Args:
        num_pages: pages of the device pool.
        page_size: tokens per page.
        max_queued: requests queued here plus admitted-but-not-started ones at most.
    """

    def __init__(self, num_pages: int, page_size: int, max_queued: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_queued = max_queued
        self._queue: OrderedDict[str, tuple[GenerateRequest, float]] = OrderedDict()
        self._footprints: dict[str, int] = {}  # admitted and not finished
        self._received: dict[str, float] = {}
        self._used = 0

    def __len__(self) -> int:
        return len(self._queue)

    def footprint(self, request: GenerateRequest) -> int:
        return -(-(len(request.tokens) + request.max_new_tokens) // self.page_size)

    def offer(self, request: GenerateRequest, now: float) -> str | None:
        """Queue ``request``; returns why it is refused instead (the queue is full)."""
        waiting = len(self._queue) + len(self._footprints)
        if len(self._queue) >= self.max_queued:
            return (
                f"overloaded: {waiting} requests are in flight and {len(self._queue)} queued "
                f"(max_queued={self.max_queued}); retry later"
            )
        self._queue[request.rid] = (request, now)
        self._received[request.rid] = now
        return None

    def queued(self, rid: str) -> bool:
        return rid in self._queue

    def withdraw(self, rid: str) -> bool:
        """Take a request out of the queue before it was admitted; whether it was there."""
        if self._queue.pop(rid, None) is None:
            return False
        self._received.pop(rid, None)
        return True

    def ready(self) -> bool:
        """The oldest queued request fits now."""
        if not self._queue:
            return False
        head = next(iter(self._queue.values()))[0]
        return self._used + self.footprint(head) <= self.num_pages

    def admit(self, running: int) -> list[GenerateRequest]:
        """The oldest queued requests that fit the pool next to the admitted ones."""
        out = []
        while self._queue:
            request, _ = next(iter(self._queue.values()))
            need = self.footprint(request)
            if self._used + need > self.num_pages:
                break
            self._queue.popitem(last=False)
            self._footprints[request.rid] = need
            self._used += need
            out.append(request)
        return out

    def received_at(self, rid: str, default: float) -> float:
        """When rank 0 got ``rid`` (``default`` elsewhere)."""
        return self._received.get(rid, default)

    def release(self, rid: str) -> None:
        """``rid`` finished (or failed): its footprint is free again."""
        self._used -= self._footprints.pop(rid, 0)
        self._received.pop(rid, None)


@dataclass(eq=False)
class Req:
    """One admitted request on one rank, from admission to finish."""

    request: GenerateRequest
    sampler: RequestSampler
    received_at: float
    stop_ids: frozenset[int] = frozenset()
    arrived_at: float = 0.0  # admitted by every rank (the step's agreement)
    handle: CacheHandle | None = None
    computed: int = 0  # tokens whose KV is in the pool
    generated: list[int] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)  # of the cached prefix, until waited
    result: RequestResult = field(init=False)

    def __post_init__(self) -> None:
        self.result = RequestResult(rid=self.request.rid)

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.request.tokens)

    def next_tokens(self, n: int) -> list[int]:
        """The ``n`` tokens the next forward computes for this request."""
        if not self.prefilled:
            return self.request.tokens[self.computed : self.computed + n]
        return self.generated[-1:]

    def segment(self, n: int) -> Segment:
        assert self.handle is not None
        return Segment(self.handle.device_pages, self.computed, n)

    def samples_after(self, n: int) -> bool:
        """Computing ``n`` more tokens yields a token to sample (the prompt's end, or a
        decode step)."""
        return self.request.max_new_tokens > 0 and self.computed + n >= len(self.request.tokens)

    @property
    def stopped(self) -> bool:
        return bool(self.generated) and self.generated[-1] in self.stop_ids

    @property
    def done(self) -> bool:
        if self.request.max_new_tokens == 0:
            return self.prefilled
        return len(self.generated) >= self.request.max_new_tokens or self.stopped

    @property
    def finish_reason(self) -> FinishReason:
        return FinishReason.STOP if self.stopped else FinishReason.LENGTH


def plan_batch(running: list[Req], max_step_tokens: int) -> list[tuple[Req, int]]:
    """This step's batch: ``(request, tokens to compute)`` in start order; every decoding
    request gets one token, prefills chunks of the rest of ``max_step_tokens`` (at least
    one token, so a prefill is never starved)."""
    decoding = [r for r in running if r.prefilled and not r.done]
    budget = max(1, max_step_tokens - len(decoding))
    batch = []
    for r in running:
        if r.prefilled:
            if not r.done:
                batch.append((r, 1))
        elif budget > 0:
            n = min(len(r.request.tokens) - r.computed, budget)
            budget -= n
            batch.append((r, n))
    return batch
