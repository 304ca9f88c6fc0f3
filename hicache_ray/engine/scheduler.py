"""The scheduler's request table: one record per request on a rank, and batch planning.

Every request of a rank lives in one :class:`RankRequest` in one :class:`RequestTable`, from
the moment the rank learns of it to its end; its ``phase`` says where it is:

* ``QUEUED`` (rank 0 only): waiting for room in the device pool. A request is admitted
  (broadcast, its prefetch started) only when the pool has room for its whole footprint,
  ``ceil((prompt + max_new_tokens) / page_size)`` pages, next to the footprints of every
  request admitted before it that has not ended; until then it waits in a FIFO queue
  (oldest first: a request that does not fit holds back the ones behind it). The sum of
  footprints bounds every device page a running or waiting request can lock (its cached
  prefix, the pages it loads, the pages it reserves), so starting a request never runs out
  of pages: unlocked pages are evicted, pages being written to L2 are waited for. Shared
  prefixes are counted once per request, which is conservative. Only a request larger than
  the whole pool (refused before this) or one past ``max_queued`` is turned away.
* ``ADMITTED`` (every rank, from the step that agreed its arrival): it holds the
  controller's :class:`~hicache_ray.cache.controller.PrefixClaim` (its locked prefix and its L3
  prefetch) until the agreement says it may run.
* ``RUNNING``: it took its prefix (a :class:`~hicache_ray.cache.hicache.CacheHandle`) and is in
  every step's batch until it finishes, fails or is aborted; then it leaves the table.

Batches (every rank, from agreed state): each step, every running request that finished its
prompt decodes one token; prefills, oldest first, get chunks of the remaining token budget.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from hicache_ray.cache.controller import PrefixClaim
from hicache_ray.cache.handle import CacheHandle
from hicache_ray.cache.memory import Transfer
from hicache_ray.engine.hold import SCAN_HELD, SiblingHold
from hicache_ray.engine.model.transformer import Segment
from hicache_ray.engine.request import (
    ErrorKind,
    FinishReason,
    GenerateRequest,
    RequestResult,
    failed_result,
)
from hicache_ray.engine.sampling import RequestSampler

__all__ = ["Phase", "RankRequest", "RequestTable", "plan_batch", "split_start"]


class Phase(enum.Enum):
    """Where a request is on a rank (see the module docstring)."""

    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"


@dataclass(eq=False)
class RankRequest:
    """One request on one rank, from its arrival to its end."""

    request: GenerateRequest
    sampler: RequestSampler
    received_at: float  # rank 0: submitted; other ranks: arrived
    stop_ids: frozenset[int] = frozenset()
    phase: Phase = Phase.QUEUED
    footprint: int = 0  # rank 0: device pages of its admission budget, once admitted
    arrived_at: float = 0.0  # admitted by every rank (the step's agreement)
    admit_step_at: float = 0.0  # the start of the step that admitted it
    admit_agreement_s: float = 0.0  # that step's agreement
    claim: PrefixClaim | None = None  # ADMITTED: its prefix claim
    handle: CacheHandle | None = None  # RUNNING: its cached prefix and reserved pages
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


class RequestTable:
    """Every request of one rank, one record each, with rank 0's admission budget.

    Args:
        num_pages: pages of the device pool.
        page_size: tokens per page.
        max_queued: requests waiting to start at most (queued or admitted; rank 0 refuses
            one more as overloaded).
    """

    def __init__(self, num_pages: int, page_size: int, max_queued: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_queued = max_queued
        self._records: dict[str, RankRequest] = {}
        self._queue: deque[RankRequest] = deque()  # QUEUED, oldest first
        self._admitted: dict[str, RankRequest] = {}  # ADMITTED, in admission order
        self.running: list[RankRequest] = []  # RUNNING, in start order
        self._used = 0  # pages of the footprints rank 0 admitted, not ended

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, rid: object) -> bool:
        return rid in self._records

    def get(self, rid: str) -> RankRequest | None:
        """The record of ``rid``, or None when it is not on this rank."""
        return self._records.get(rid)

    @property
    def num_queued(self) -> int:
        """Requests waiting to start: queued (rank 0) or admitted."""
        return len(self._queue) + len(self._admitted)

    # ------------------------------------------------------------- rank 0

    def footprint(self, request: GenerateRequest) -> int:
        """Device pages ``request`` may lock at most: its prompt and its answer."""
        return -(-(len(request.tokens) + request.max_new_tokens) // self.page_size)

    def offer(self, record: RankRequest) -> RequestResult | None:
        """Queue ``record``; returns its error result instead when it is refused (its id is
        in flight, or the queue is full)."""
        if record.rid in self._records:
            in_flight = f"rid: request id {record.rid!r} is already in flight"
            return failed_result(record.rid, in_flight)
        if self.num_queued >= self.max_queued:
            overloaded = (
                f"overloaded: {len(self._records)} requests are in flight and "
                f"{self.num_queued} wait to start (max_queued={self.max_queued}); retry later"
            )
            return failed_result(record.rid, overloaded, ErrorKind.OVERLOADED)
        record.phase = Phase.QUEUED
        self._records[record.rid] = record
        self._queue.append(record)
        return None

    def withdraw(self, rid: str) -> bool:
        """Take a queued request out of the table; whether it was queued."""
        record = self._records.get(rid)
        if record is None or record not in self._queue:
            return False
        self._queue.remove(record)
        del self._records[rid]
        return True

    def ready(self, hold: SiblingHold | None = None) -> bool:
        """A queued request fits now and is not held (by ``hold``)."""
        return bool(self._admissible(hold, admit=False))

    def admit(self, hold: SiblingHold | None = None) -> list[GenerateRequest]:
        """Take the oldest queued requests that fit the pool next to the admitted ones and
        that ``hold`` does not keep waiting for a request ahead (:mod:`.hold`), for this
        step to broadcast (their records become ``ADMITTED`` when it agrees them)."""
        return self._admissible(hold, admit=True)

    def _admissible(self, hold: SiblingHold | None, *, admit: bool) -> list[GenerateRequest]:
        """The queued requests admitted now, oldest first (``admit``: taken off the queue,
        their footprints counted; else only the first one, nothing changed)."""
        out: list[GenerateRequest] = []
        used, held = self._used, 0
        for record in list(self._queue):
            need = self.footprint(record.request)
            if used + need > self.num_pages or held > SCAN_HELD:
                break
            if hold is not None and hold.held(record.request, self._ahead(out)):
                held += 1
                continue
            out.append(record.request)
            if not admit:
                break
            self._queue.remove(record)
            record.footprint = need
            self._used = used = used + need
        return out

    def _ahead(self, picked: list[GenerateRequest]) -> Iterator[tuple[GenerateRequest, int]]:
        """Requests ahead of a queued one that may still compute pages of their prompt, each
        with the leading pages it has (its cached or computed ones; 0 for those picked in
        this admission: they share with it what its own cache holds)."""
        page = self.page_size
        for r in self.running:
            if not r.prefilled:
                yield r.request, r.computed // page
        for r in self._admitted.values():
            yield r.request, 0 if r.claim is None else r.claim.cached
        for request in picked:
            yield request, 0

    # ---------------------------------------------------------- every rank

    def arrive(self, record: RankRequest, claim: PrefixClaim, now: float) -> None:
        """Every rank agreed ``record``'s arrival; ``claim`` is its prefix claim."""
        record.phase, record.claim, record.arrived_at = Phase.ADMITTED, claim, now
        self._records[record.rid] = record
        self._admitted[record.rid] = record

    def claims(self) -> list[PrefixClaim]:
        """The claims of the admitted requests, in admission order (the step vector's)."""
        return [r.claim for r in self._admitted.values() if r.claim is not None]

    def start(self, record: RankRequest, handle: CacheHandle) -> None:
        """``record`` took its prefix: it runs from now on."""
        del self._admitted[record.rid]
        record.phase, record.claim, record.handle = Phase.RUNNING, None, handle
        self.running.append(record)

    def end(self, rid: str) -> RankRequest | None:
        """``rid`` finished, failed or was aborted: its record leaves the table (and its
        footprint the budget); the caller releases what it held. None: not here."""
        record = self._records.pop(rid, None)
        if record is None:
            return None
        if record.phase is Phase.QUEUED and record in self._queue:
            self._queue.remove(record)
        self._admitted.pop(rid, None)
        if record in self.running:
            self.running.remove(record)
        self._used -= record.footprint
        return record


def plan_batch(running: list[RankRequest], max_step_tokens: int) -> list[tuple[RankRequest, int]]:
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


def split_start(seq: RankRequest, started: float) -> None:
    """The parts of ``seq``'s TTFT up to its start, from the times its admitting step, L3
    query and reads began and ended (each clamped into order, so the parts are disjoint)."""
    split = seq.result.ttft_split
    step_at = min(max(seq.admit_step_at, seq.received_at), started)
    admitted = min(max(seq.arrived_at, step_at), started)
    task = seq.claim.task if seq.claim is not None else None
    queried = read_from = read_to = admitted
    if task is not None and task.queried_at:
        queried = min(max(task.queried_at, admitted), started)
        read_from = read_to = queried
        if task.read_started_at and task.read_done_at:
            read_from = min(max(task.read_started_at, queried), started)
            read_to = min(max(task.read_done_at, read_from), started)
    split.queue_s = step_at - seq.received_at if seq.admit_step_at else admitted - seq.received_at
    split.query_s = queried - admitted
    split.prefetch_s = read_to - read_from
    split.agreement_s = (admitted - step_at) + (read_from - queried) + (started - read_to)
