"""One rank's cache controller: L1/L2 cache, L3 pipelines and the per-step agreement.

The scheduler loop of every rank calls, in the same order on every rank::

    result = ctl.step(arrivals, pending=claims)  # rank 0 passes new requests
    claims += result.admitted                     # the caller keeps the claims, in order
    for claim in result.runnable:                 # agreed: identical on every rank
        handle = ctl.take(claim)                  # lock + load the agreed prefix
        claims.remove(claim)                      # reserve, compute, cache_prompt, finish

The controller keeps no registry of requests: it hands out a :class:`PrefixClaim` per
admitted request and describes, each step, the claims its caller passes back (``pending``:
every claim not taken or cancelled, in admission order). ``step`` makes exactly the
collectives of :mod:`hicache_ray.cache.controller.protocol`, whatever this rank's local state.
``take`` and ``cancel`` change which requests the next step's vector describes, so every
rank calls them for the same requests between the same steps (``runnable`` is agreed).

Every prefix length the ranks act on (cached, stored, fetched) is an agreed MIN, so a
rank whose storage misses pages, fails or is slow only shortens what everyone uses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import torch

from hicache_ray.base.config import CacheConfig
from hicache_ray.base.layout import ShardKV
from hicache_ray.base.stats import ControllerStats
from hicache_ray.base.tokens import TokenIds
from hicache_ray.cache.controller.acks import Acknowledger
from hicache_ray.cache.controller.backup import BackupPipeline
from hicache_ray.cache.controller.claim import StepResult
from hicache_ray.cache.controller.claims import Claims, PrefixClaim
from hicache_ray.cache.controller.consensus import Consensus, ConsensusError, LocalConsensus
from hicache_ray.cache.controller.prefetch import PrefetchPipeline
from hicache_ray.cache.controller.protocol import Arrival, ArrivalLike, Header, StepCodec
from hicache_ray.cache.controller.reads_first import BACKLOG_SHARE
from hicache_ray.cache.events import CacheEvents
from hicache_ray.cache.handle import CacheHandle
from hicache_ray.cache.hicache import HiCache
from hicache_ray.cache.memory import DevicePool
from hicache_ray.keys import plan_shard
from hicache_ray.storage import StorageBackend, create_backend

__all__ = ["ARRIVAL_QUERY_WAIT_S", "QUIET_WAIT_S", "CacheController", "StepResult"]

# How long a step that admits requests waits for their L3 queries before it agrees on them
# (one that ends in time runs in this step); a slow or dead store costs it once per step.
ARRIVAL_QUERY_WAIT_S = 0.005
# How long a quiet step (no rank admits, nothing runs or is runnable: every request waits on
# L3) lets each rank finish its own queries and reads before taking its facts, so that the
# step that sees the last rank's read end is this one, not a later poll.
QUIET_WAIT_S = 0.02


class CacheController:
    """L1/L2 cache plus L3 prefetch and backup pipelines, agreed across ranks each step.

    Args:
        config: cache settings.
        kv: this rank's KV shard facts.
        consensus: the group of ranks (a single rank when omitted).
        storage: an L3 backend; created from ``config.storage`` when omitted.
        device, host_budget_bytes, num_copy_workers: as for :class:`HiCache`.
        clock: monotonic seconds (tests pass a fake one for ``timeout`` policies).
    """

    def __init__(
        self,
        config: CacheConfig,
        kv: ShardKV,
        *,
        consensus: Consensus | None = None,
        storage: StorageBackend | None = None,
        device: torch.device | None = None,
        host_budget_bytes: int | None = None,
        num_copy_workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.consensus = consensus or LocalConsensus()
        self.cache = HiCache(
            config,
            kv,
            device=device,
            host_budget_bytes=host_budget_bytes,
            num_copy_workers=num_copy_workers,
        )
        self._owns_storage = storage is None and config.storage.backend != "none"
        self.plan = None
        if storage is not None or self._owns_storage:
            self.plan = plan_shard(kv, config)
        if self._owns_storage:
            storage = create_backend(config.storage, self.plan)  # type: ignore[arg-type]
        self.storage = storage
        self.counters = ControllerStats(cache=self.cache.counters)
        self.prefetch: PrefetchPipeline | None = None
        self.backup: BackupPipeline | None = None
        if storage is not None and self.plan is not None:
            batch, host = config.storage.batch_size_pages, self.cache.host_pool
            threads = config.storage.read_threads
            self.backup = BackupPipeline(storage, self.plan, host, batch)
            turn = self.backup.turn  # backups wait for this rank's L3 queries and reads
            self.prefetch = PrefetchPipeline(storage, self.plan, host, batch, threads, turn)
        self.acks = Acknowledger(self.cache, self.backup, self.counters)
        self.claims = Claims(
            self.cache, config, self.prefetch, self.counters, self.note_failure, clock
        )
        self._codec = StepCodec(Arrival)
        self.events: CacheEvents | None = None  # the tree's journal (rank 0 publishes it)
        self._step = 0
        self._failed_since_step = False
        self._contributed: list[int] | None = None  # this rank's facts at the last exchange
        self._busy_agreed = False
        self.quiet_wait_s = QUIET_WAIT_S

    # ------------------------------------------------------------------- step

    def step(
        self,
        arrivals: Sequence[ArrivalLike] = (),
        aborts: Sequence[str] = (),
        pending: Sequence[PrefixClaim] = (),
        *,
        quiet: bool = False,
    ) -> StepResult:
        """Agree on this step's facts with every rank and admit rank 0's ``arrivals``;
        rank 0's ``aborts`` reach every rank at the same step (the caller cancels those it
        holds). ``pending``: the claims of every request admitted before and not taken or
        cancelled, in admission order; the caller keeps them (this rank's scheduler table).
        ``quiet``: the caller runs no request (the same on every rank, as what runs is
        agreed); when no rank admits anything either and no pending claim is runnable,
        each rank first waits up to ``quiet_wait_s`` for its own L3 queries and reads.

        Arrivals are trusted (checked at the scheduler's door): unique ids, non-empty
        prompts of token ids in ``[0, 2**32)``, of the controller's ``arrival_type``.

        Raises:
            ValueError: ``arrivals`` or ``aborts`` on a rank other than 0.
            ConsensusError: a peer timed out or died, or the ranks disagree on how many
                requests are pending.
        """
        if (arrivals or aborts) and self.consensus.rank != 0:
            raise ValueError("only rank 0 admits requests; pass no arrivals on other ranks")
        admitting = len(arrivals) + len(aborts)
        payload = self._codec.encode(arrivals, aborts) if admitting else b""
        facts = self._local_facts(admitting, len(payload), pending)
        self._step += 1
        stats, start = self.counters, time.perf_counter()
        stats.steps += 1
        # Round 1: does any rank contribute something new? (An idle step is this integer;
        # a rank whose own L3 work runs says yes, and retakes its facts after the round.)
        waiting = self.prefetching
        changed = bool(admitting) or waiting or facts != self._contributed
        news = self.consensus.all_reduce_min([-2 if admitting else -int(changed)], self._step)
        if not news[0]:
            spent = time.perf_counter() - start
            stats.consensus_s += spent
            runnable = self._runnable(pending, ())
            return StepResult(self._step, [], runnable, self._busy_agreed, agreement_s=spent)
        if waiting:
            facts = self._facts_after_round_one(facts, pending, quiet and news[0] == -1)
        agreed = self.consensus.all_reduce_min(facts, self._step)
        header = Header.decode(agreed, self._step)
        new: list[Any] = []
        aborted: list[str] = []
        if header.arrivals:
            data = self.consensus.broadcast_bytes(payload, header.payload_bytes, self._step)
            broadcast = self._codec.decode(data)
            new, aborted = broadcast.arrivals, broadcast.aborts
        spent = time.perf_counter() - start
        stats.consensus_s, stats.full_steps = stats.consensus_s + spent, stats.full_steps + 1
        self._contributed = facts
        admitted = self._apply(header, agreed, pending, new)
        runnable = self._runnable([*pending, *admitted], aborted)
        return StepResult(
            self._step, admitted, runnable, self._busy_agreed, aborted=aborted, agreement_s=spent
        )

    def _local_facts(
        self, admitting: int, payload_bytes: int, pending: Sequence[PrefixClaim]
    ) -> list[int]:
        """This rank's step vector, after polling the cache and flushing its events."""
        self.cache.poll()
        if self.events is not None:  # what the last step's work changed, as one batch
            self.events.flush()
        facts = Header.local(
            arrivals=admitting,
            payload_bytes=payload_bytes,
            acks=self.acks.facts(),
            failed=self._failed_since_step,
            busy=self._busy(),
            num_requests=len(pending),
        )
        return facts + self.claims.facts(pending)

    def _apply(
        self,
        header: Header,
        agreed: list[int],
        pending: Sequence[PrefixClaim],
        new: list[ArrivalLike],
    ) -> list[PrefixClaim]:
        """What every rank does with the facts agreed in a full step; the new claims."""
        if header.failed and not self._failed_since_step:
            self.counters.peer_failures += 1
        self._failed_since_step = False
        self.acks.apply(*header.acks)
        self.claims.apply(pending, agreed[Header.SIZE :])
        admitted = [self.claims.admit(arrival) for arrival in new]
        if admitted:  # agreed: every rank runs this round for the same arrivals
            self._agree_arrivals(admitted)
        self._busy_agreed = header.busy or bool(pending) or bool(admitted)
        return admitted

    def _facts_after_round_one(
        self, facts: list[int], pending: Sequence[PrefixClaim], quiet: bool
    ) -> list[int]:
        """This rank's facts retaken after round 1 (its own L3 work may have ended while it
        waited there). In a quiet step that admits nothing and runs nothing it first waits
        for that work (``quiet_wait_s`` at most, nor past a prefetch deadline) while the
        others wait in round 2: their last read is agreed in this step, not a later poll."""
        if quiet and not self._runnable(pending, ()):
            started = time.perf_counter()
            self.claims.wait_local(pending, self.quiet_wait_s)
            self.counters.quiet_wait_s += time.perf_counter() - started
        return facts[: Header.SIZE] + self.claims.facts(pending)

    def _runnable(self, claims: Sequence[PrefixClaim], aborted: Sequence[str]) -> list[PrefixClaim]:
        policy = self.config.prefetch.policy
        return [c for c in claims if c.runnable(policy) and c.rid not in aborted]

    def _agree_arrivals(self, claims: list[PrefixClaim]) -> None:
        """One more MIN round, over the requests admitted in this step: one that needs no
        L3 query (or whose query ends within ``ARRIVAL_QUERY_WAIT_S``: one store round
        trip) is runnable in this step, not after the next one (which would make it wait
        for a whole forward pass)."""
        self.claims.wait_queries(claims, ARRIVAL_QUERY_WAIT_S)
        start = time.perf_counter()
        agreed = self.consensus.all_reduce_min(self.claims.facts(claims), self._step)
        self.counters.consensus_s += time.perf_counter() - start
        self.claims.apply(claims, agreed, on_arrival=True)

    def publish_events(self, keep_batches: int = 256) -> CacheEvents:
        """Journal this rank's tree as cache events (one batch per step that changed it;
        :mod:`hicache_ray.cache.events`); the last ``keep_batches`` batches stay readable."""
        if self.events is None:
            self.events = CacheEvents(self.cache.tree, keep_batches=keep_batches)
            self.cache.tree.observer = self.events
        return self.events

    def broadcast_as(self, arrival_type: type[Any]) -> None:
        """Broadcast arrivals as ``arrival_type`` structs (a scheduler's own request type, so
        every rank decodes the whole request once; :class:`Arrival` until called)."""
        self._codec = StepCodec(arrival_type)

    def agree_failure(self, ordinal: int) -> None:
        """Every rank calls this when the request at position ``ordinal`` of this step's
        work raised: a MIN all-reduce checks that every rank failed the same request (the
        failure was the request's own, not this rank's). A rank that did not fail never
        calls it, so the others time out here and the deployment re-forms.

        Raises:
            ConsensusError: the ranks failed different requests, or a peer did not join.
        """
        agreed = self.consensus.all_reduce_min([ordinal, -ordinal], self._step)
        if agreed != [ordinal, -ordinal]:
            raise ConsensusError(
                f"step {self._step}: ranks failed different requests ({agreed[0]}..{-agreed[1]} "
                f"vs {ordinal} here); the group must be re-formed"
            )

    def note_failure(self) -> None:
        """Record a local failure; the next step tells every rank one happened."""
        self._failed_since_step = True

    # ---------------------------------------------------------------- requests

    @property
    def rank(self) -> int:
        """This rank's index in its consensus group (0 admits requests)."""
        return self.consensus.rank

    @property
    def prefetching(self) -> bool:
        """This rank's own L3 queries or reads run (their end wakes the step loop)."""
        return self.claims.local_work

    @property
    def device_pool(self) -> DevicePool:
        """This rank's L1 pool (the forward reads and writes its KV there)."""
        return self.cache.device_pool

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of this rank's KV shard."""
        return self.cache.kv.page_bytes

    def take(self, claim: PrefixClaim, max_pages: int | None = None) -> CacheHandle:
        """Lock and start loading the agreed cached prefix of ``claim`` (at most
        ``max_pages`` pages); it leaves the step vector. Same order on every rank.

        Raises:
            HiCacheError: the claim has no agreed prefix yet, or was taken or cancelled.
        """
        return self.claims.take(claim, max_pages)

    def cancel(self, claim: PrefixClaim) -> None:
        """Drop an admitted request without running it. Same order on every rank."""
        self.claims.cancel(claim)

    def reserve(self, handle: CacheHandle, num_tokens: int) -> list[int]:
        return self.cache.reserve(handle, num_tokens)

    def finish(self, handle: CacheHandle, tokens: TokenIds) -> int:
        return self.cache.finish(handle, tokens)

    def cache_prompt(self, handle: CacheHandle, key: bytes) -> int:
        return self.cache.cache_prompt(handle, key)

    def release(self, handle: CacheHandle) -> None:
        self.cache.release(handle)

    def wait_ready(self, handle: CacheHandle, timeout: float | None = None) -> None:
        failures = self.cache.counters.load_failures
        self.cache.wait_ready(handle, timeout)
        if self.cache.counters.load_failures != failures:
            self.note_failure()

    # ------------------------------------------------------------- background

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Around a forward pass: backups wait (between batches) until it ends, unless 1/8
        of L2 waits on them. NOTE: a backup holds its L2 pages until stored; under steady
        load backups paused for every forward fill L2 with their pages, and hits lose room
        (for L3 reads, L1 -> L2 copies). ``backup_ran_beside_forward`` counts such passes."""
        if self.backup is None:
            yield
            return
        if self.acks.pending_backup_pages * BACKLOG_SHARE >= self.cache.host_pool.num_pages:
            self.counters.backup_ran_beside_forward += 1
            yield
            return
        with self.backup.paused():
            yield

    def wait_requests(self, timeout: float | None = None) -> None:
        """Wait (locally) for the storage queries and reads of admitted requests only: what
        a scheduler with nothing runnable waits for (backups and host writes run on)."""
        self.claims.wait(timeout)

    def settle(self, timeout: float | None = None) -> None:
        """Wait (locally, no collective) until this rank's background work is done:
        host writes, storage queries and reads of admitted requests, backups (which stop
        yielding to reads meanwhile: no step can agree those done while this waits)."""
        self.cache.flush()
        self.claims.wait(timeout)
        with self.backup.turn.awaited() if self.backup else contextlib.nullcontext():
            self.acks.wait_backups(timeout)

    def _busy(self) -> bool:
        return bool(
            self.cache.writes_in_flight or self.cache.completed_writes or self.acks.pending_backups
        )

    def stats(self) -> ControllerStats:
        """A snapshot of every counter and gauge of this rank."""
        s = msgspec.structs.replace(self.counters, cache=self.cache.counters.snapshot())
        s.unfulfilled_tokens = dict(self.counters.unfulfilled_tokens)
        s.lookahead_hints = dict(self.counters.lookahead_hints)  # the hint thread's counts
        dev, host = self.cache.device_pool.allocator, self.cache.host_pool.allocator
        s.device_pages_used, s.device_pages_total = dev.num_used_pages, dev.num_pages
        s.host_pages_used, s.host_pages_total = host.num_used_pages, host.num_pages
        s.host_pages_prefetching = self.claims.prefetch_host_pages
        s.running_prefetches = self.claims.num_fetching
        s.pending_backups = self.acks.pending_backups
        s.backup_waited_for_reads = self.backup.turn.waits if self.backup else 0
        return s

    def close(self) -> None:
        """Stop every pipeline (prefetch, backup, transfers); safe to call twice."""
        self.claims.close()
        if self.prefetch is not None:
            self.prefetch.close()
        if self.backup is not None:
            self.backup.close()
        self.cache.close()
        if self._owns_storage and self.storage is not None:
            self.storage.close()

    def check_integrity(self) -> None:
        """Assert pool accounting across the tree, requests and prefetch slots."""
        self.cache.check_integrity(held_host_pages=self.claims.prefetch_host_pages)
