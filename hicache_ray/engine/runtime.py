"""The per-rank scheduler: admit, agree, run every request in one batched forward per step.

Every rank of a deployment runs :meth:`RankRuntime.step` in lock step; rank 0 alone takes
:meth:`RankRuntime.submit` and :meth:`RankRuntime.abort` calls and reports results. One step:

1. rank 0 admits the oldest of its queued requests while the device pool has room for them
   (:class:`~hicache_ray.engine.scheduler.RequestTable`); the others wait in its FIFO queue, and
   one past ``max_queued`` is refused as overloaded;
2. the controller's step agrees every fact of the step: the new requests (admitted on every
   rank, their prefetches started), the aborted ones, and which ones may run now;
3. each runnable request takes its agreed cached prefix (loading its L2 part under the
   forward) and reserves device pages for the rest of its prompt and its answer;
4. one forward computes a batch: every running request's next token, then chunks of the
   prefills (oldest first) up to ``max_step_tokens``; the tokens are sampled on the last
   stage and broadcast, so every rank appends the same ones; the whole pages of the
   prompt computed so far go into the tree (``HiCache.cache_prompt``), for the requests
   that share them while this one still runs;
5. a request that reached ``max_new_tokens``, an EOS or a stop token inserts the KV of its
   prompt and answer into the cache and releases its locks.

Every request of the rank is one :class:`~hicache_ray.engine.scheduler.RankRequest` in one
:class:`~hicache_ray.engine.scheduler.RequestTable`; the controller's claim on its prefix lives in
that record. Requests are checked at the door (:meth:`RankRuntime.submit`, or the caller's
own door and :meth:`RankRuntime.enqueue`) and trusted inside: nothing invalid reaches a
collective, and rank 0 broadcasts the request itself (one msgpack encoding, decoded once
per rank). An exception raised while running one request fails it alone: the ranks that
raised agree on it (:meth:`CacheController.agree_failure`; a failed batch is retried
request by request); a rank that did not raise never joins, the others time out and the
deployment re-forms.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from hicache_ray.base.config import SchedulerConfig
from hicache_ray.base.errors import CollectiveError
from hicache_ray.base.tokens import TOKEN_BYTES, encode_tokens
from hicache_ray.cache.controller import CacheController, PrefixClaim
from hicache_ray.cache.tree.peek import cached_pages
from hicache_ray.engine.hints import LookAhead
from hicache_ray.engine.hold import SiblingHold
from hicache_ray.engine.model import ReferenceModel
from hicache_ray.engine.model.pipe import StageExecutor
from hicache_ray.engine.request import (
    ErrorKind,
    FinishReason,
    GenerateRequest,
    RequestError,
    RequestResult,
    SamplingParams,
    StepOutput,
    check_limits,
    check_request,
    error_result,
    failed_result,
)
from hicache_ray.engine.sampling import RequestSampler
from hicache_ray.engine.scheduler import Phase, RankRequest, RequestTable, plan_batch, split_start

__all__ = ["GenerateRequest", "RankRuntime", "RequestResult", "StepOutput"]

log = logging.getLogger(__name__)


class RankRuntime:
    """One rank's scheduler over a cache controller and its share of the model.

    Args:
        controller: this rank's cache (its consensus group spans the deployment's ranks).
        model: this rank's share of the model.
        executor: runs a batch across the ranks (made for a single rank when omitted).
        keep_logits: keep the logits of every sampled token per request in ``logits``
            (tests; the last PP stage only).
        reuse_prefix: take cached prefixes; False computes every prompt whole (the no-cache
            baseline of benchmarks; finished requests are still inserted).
        scheduler: the step token budget, the running and queue bounds (None: defaults).
    """

    def __init__(
        self,
        controller: CacheController,
        model: ReferenceModel,
        *,
        executor: StageExecutor | None = None,
        keep_logits: bool = False,
        reuse_prefix: bool = True,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        self.ctl = controller
        self.model = model
        self.executor = executor or StageExecutor(model)
        self.busy = False  # whether the last step left work (requests, background copies)
        # Fault injection (tests, `bench faults`): called with the phase, "admit" (new
        # requests agreed, their prefetches started), "prefill" or "decode", and the request
        # id ("" for admit) before that work runs.
        self.on_phase: Callable[[str, str], None] | None = None
        self.page_size = controller.config.page_size
        self.keep_logits = keep_logits
        self.reuse_prefix = reuse_prefix
        sched = scheduler or SchedulerConfig()
        self.max_step_tokens = sched.max_step_tokens
        self.max_running = sched.max_running
        self.logits: dict[str, list[torch.Tensor]] = {}
        controller.broadcast_as(GenerateRequest)  # every rank decodes our request type
        self._pool_tokens = controller.device_pool.num_tokens
        pages = controller.device_pool.num_pages
        self.table = RequestTable(pages, self.page_size, sched.max_queued)
        tree = controller.cache.tree
        self._hold = (  # rank 0 holds a request while one ahead computes their prefix
            SiblingHold(self.page_size, lambda r: cached_pages(tree, r.tokens, r.cache_salt))
            if reuse_prefix and sched.hold_siblings
            else None
        )
        self._aborts: list[str] = []  # rank 0: aborted by callers, for the next step
        self.look_ahead = LookAhead(controller.claims, lambda: controller.counters.steps)
        self._out = StepOutput()

    # -------------------------------------------------------------- requests

    def submit(self, request: object) -> None:
        """Check and queue a request (rank 0; the door for embedders): a bad one is
        answered with an error result at the next step, alone."""
        try:
            checked = self.check(request)
        except RequestError as exc:
            self._out.results.append(error_result(request, str(exc)))
            return
        self.enqueue(checked)

    def check(self, request: object) -> GenerateRequest:
        """``request`` checked against the model and the pool (any thread); raises
        :class:`RequestError` naming what is wrong."""
        r = check_request(request)
        cfg = self.model.config
        check_limits(r, cfg.vocab_size, self._pool_tokens, cfg.max_context)
        return r

    def enqueue(self, request: GenerateRequest) -> None:
        """Queue a request its door checked (rank 0: the rank actor, or :meth:`submit`): one
        whose id is in flight, or past ``max_queued``, is answered with an error result at
        the next step."""
        if self.ctl.rank != 0:
            raise ValueError("requests are submitted on rank 0")
        refused = self.table.offer(self._record(request, time.perf_counter()))
        if refused is not None:
            self._out.results.append(refused)

    def abort(self, rid: str) -> None:
        """Stop request ``rid`` (rank 0): it ends at the next step with ``finish_reason``
        ``abort`` and the tokens it generated so far."""
        if self.table.withdraw(rid):
            self._out.results.append(RequestResult(rid=rid, finish_reason=FinishReason.ABORT))
        elif rid in self.table:
            self._aborts.append(rid)

    def _record(self, request: GenerateRequest, received_at: float) -> RankRequest:
        sampling = request.sampling
        return RankRequest(
            request,
            RequestSampler(request.rid, sampling),
            received_at,
            stop_ids=self._stop_ids(sampling),
        )

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        eos = () if sampling.ignore_eos else self.model.config.eos_token_ids
        return frozenset((*eos, *sampling.stop_token_ids))

    # ------------------------------------------------------------------ step

    @property
    def has_work(self) -> bool:
        """Requests queued, admitted or running on this rank."""
        return bool(self.table or self._aborts)

    @property
    def has_runnable_work(self) -> bool:
        """Work for the next step now (not only requests waiting on prefetches)."""
        return bool(self.table.running or self._aborts or self.table.ready(self._hold))

    @property
    def num_queued(self) -> int:
        """Requests waiting to start (rank 0's queue and the admitted ones)."""
        return self.table.num_queued

    def step(self) -> StepOutput:
        """One scheduler iteration (every rank); returns what it finished and generated."""
        arrivals = self.table.admit(self._hold)
        aborts, self._aborts = self._aborts, []
        began = time.perf_counter()  # the admitting step's clock covers its look-ahead
        self.look_ahead.arrivals(arrivals)  # looked up in L3 while the ranks agree
        quiet = not self.table.running  # the same on every rank: what runs is agreed
        agreed = self.ctl.step(arrivals, aborts, pending=self.table.claims(), quiet=quiet)
        if agreed.admitted and self.on_phase is not None:
            self.on_phase("admit", "")
        now = time.perf_counter()
        for claim in agreed.admitted:
            record = self._arrive(claim, now)
            record.admit_step_at, record.admit_agreement_s = began, agreed.agreement_s
        for rid in agreed.aborted:
            self._drop(
                rid, RequestResult(rid=rid, finish_reason=FinishReason.ABORT), keep_output=True
            )
        room = max(0, self.max_running - len(self.table.running))
        for ordinal, claim in enumerate(agreed.runnable[:room]):
            self._guarded(ordinal, claim.rid, self._start)
        if self.table.running:
            self._forward()
        out, self._out = self._out, StepOutput()
        # A request finished here started host writes the agreement has not seen yet.
        self.busy = agreed.busy or bool(out.results)
        return out

    def _arrive(self, claim: PrefixClaim, now: float) -> RankRequest:
        request = claim.arrival
        assert isinstance(request, GenerateRequest)  # the controller broadcasts our type
        record = self.table.get(request.rid) or self._record(request, now)
        self.table.arrive(record, claim, now)
        return record

    # -------------------------------------------------------------- starting

    def _start(self, rid: str) -> None:
        seq = self.table.get(rid)
        assert seq is not None and seq.claim is not None
        request = seq.request
        started = time.perf_counter()
        seq.result.prefetch_s = started - seq.received_at
        split_start(seq, started)
        max_pages = (len(request.tokens) - 1) // self.page_size if self.reuse_prefix else 0
        handle = self.ctl.take(seq.claim, max_pages=max_pages)
        self.table.start(seq, handle)  # from here, dropping it releases the handle
        cached = handle.num_cached_tokens
        seq.computed = cached
        seq.loads = list(handle.loads)
        result = seq.result
        result.device_hit_tokens = handle.device_hit_tokens
        result.host_hit_tokens = handle.host_hit_tokens
        result.recomputed_tokens = len(request.tokens) - cached
        # Pages this request prefetched that another request already loaded to the device
        # are device hits for this one: L3 hits are the prefetched part of the host hit.
        result.storage_hit_tokens = min(handle.storage_hit_tokens, handle.host_hit_tokens)
        page_bytes = self.ctl.page_bytes
        result.load_bytes = handle.host_hit_tokens // self.page_size * page_bytes
        result.prefetch_bytes = handle.storage_hit_tokens // self.page_size * page_bytes
        # Room for the rest of the prompt and the whole answer: the admission budget kept
        # it free, so this cannot run out (pages being written to L2 are waited for).
        self.ctl.reserve(handle, len(request.tokens) - cached + request.max_new_tokens)
        result.queue_s = time.perf_counter() - seq.received_at

    # --------------------------------------------------------------- forward

    def _forward(self) -> None:
        """One batch over the running requests; on a failure raised by request code, each
        request of the batch again on its own, so the one that raises fails alone."""
        batch = plan_batch(self.table.running, self.max_step_tokens)
        try:
            self._run(batch)
        except CollectiveError:
            raise
        except Exception as exc:
            log.warning(
                "a batch of %d requests failed (%s); running them one by one", len(batch), exc
            )
            self.ctl.agree_failure(-1)
            for ordinal, (seq, length) in enumerate(batch):
                if seq.phase is Phase.RUNNING and seq.rid in self.table:  # not dropped yet
                    self._guarded(ordinal, seq.rid, self._run_alone(seq, length))

    def _run_alone(self, seq: RankRequest, length: int) -> Callable[[str], None]:
        def run(_: str) -> None:
            self._run([(seq, length)])

        return run

    def _run(self, batch: list[tuple[RankRequest, int]]) -> None:
        if self.on_phase is not None:
            for seq, _ in batch:
                self.on_phase("decode" if seq.prefilled else "prefill", seq.rid)
        ids = torch.tensor([t for seq, n in batch for t in seq.next_tokens(n)], dtype=torch.long)
        segments = [seq.segment(n) for seq, n in batch]
        sampled = [i for i, (seq, n) in enumerate(batch) if seq.samples_after(n)]
        ends = torch.tensor([n for _, n in batch]).cumsum(0) - 1
        rows = [int(ends[i]) for i in sampled]
        first = [seq for seq, _ in batch if seq.loads]
        stalled = [0.0]  # seconds the forward waited for loads

        def wait_layer(layer: int) -> None:
            began = time.perf_counter()
            for seq in first:
                assert seq.handle is not None
                seq.handle.wait_layer(layer)
            stalled[0] += time.perf_counter() - began

        def sample(logits: torch.Tensor) -> list[int]:
            return [batch[i][0].sampler.sample(logits[j]) for j, i in enumerate(sampled)]

        keep = self._keep(batch, sampled) if self.keep_logits else None
        began = time.perf_counter()
        with self.ctl.computing():
            tokens = self.executor.run(
                ids,
                segments,
                self.ctl.device_pool,
                rows,
                sample,
                wait_layer=wait_layer if first else None,
                keep=keep,
            )
        forward = time.perf_counter() - began - stalled[0]
        self.ctl.claims.cost.note_forward(len(ids), forward)  # L3 reads are weighed by it
        for seq in first:
            assert seq.handle is not None
            self.ctl.wait_ready(seq.handle)  # surfaces (and counts) a failed load
            seq.result.load_s = max((t.latency_s or 0.0 for t in seq.loads), default=0.0)
            seq.loads = []
        now = time.perf_counter()
        for seq, n in batch:
            if not seq.generated:  # a prefill step (or the one that samples its first token)
                split = seq.result.ttft_split
                split.forward_s += forward
                split.load_s += now - began - forward
            seq.computed += n
        for i, token in zip(sampled, tokens, strict=True):
            seq = batch[i][0]
            if not seq.generated:
                seq.result.ttft_s = now - seq.received_at
                seq.result.ttft_split.close(seq.result.ttft_s)
            seq.generated.append(token)
            self._out.tokens.setdefault(seq.rid, []).append(token)
        for seq, _ in batch:
            if seq.done:
                self._finish(seq)
            elif len(seq.generated) <= 1:  # a prefill step: more of its prompt computed
                self._cache_prompt(seq)

    def _keep(
        self, batch: list[tuple[RankRequest, int]], sampled: list[int]
    ) -> Callable[[torch.Tensor], None]:
        def keep(logits: torch.Tensor) -> None:
            for j, i in enumerate(sampled):
                self.logits.setdefault(batch[i][0].rid, []).append(logits[j].detach().clone())

        return keep

    @property
    def first_logits(self) -> dict[str, torch.Tensor]:
        """The logits of each request's first token (tests)."""
        return {rid: rows[0] for rid, rows in self.logits.items() if rows}

    def _cache_prompt(self, seq: RankRequest) -> None:
        """The whole pages of its prompt computed so far into the tree now (each prefill
        chunk's), for the requests that share them; it keeps them locked."""
        assert seq.handle is not None
        seq.handle.prompt_key = seq.handle.prompt_key or encode_tokens(seq.request.tokens)
        computed = min(seq.computed, len(seq.request.tokens)) * TOKEN_BYTES
        self.ctl.cache_prompt(seq.handle, seq.handle.prompt_key[:computed])

    def _finish(self, seq: RankRequest) -> None:
        assert seq.handle is not None
        seq.result.latency_s = time.perf_counter() - seq.received_at
        # KV exists for the prompt and every generated token but the last.
        prompt = seq.handle.prompt_key or encode_tokens(seq.request.tokens)
        self.ctl.finish(seq.handle, prompt + encode_tokens(seq.generated[:-1]))
        self.table.end(seq.rid)
        seq.result.output_tokens = list(seq.generated)
        seq.result.finish_reason = seq.finish_reason
        self._out.results.append(seq.result)

    def _guarded(self, ordinal: int, rid: str, work: Callable[[str], None]) -> None:
        """Run one request's work; its own failure fails it alone (see the module docstring)."""
        try:
            work(rid)
        except CollectiveError:
            raise
        except Exception as exc:
            log.exception("request %s failed on rank %d", rid, self.ctl.rank)
            why = f"{type(exc).__name__}: {exc}"
            self._drop(rid, failed_result(rid, why, ErrorKind.INTERNAL))
            self.ctl.agree_failure(ordinal)

    def _drop(self, rid: str, result: RequestResult, *, keep_output: bool = False) -> None:
        """Forget a failed or aborted request and release whatever it held."""
        seq = self.table.end(rid)
        if seq is None:
            return
        if seq.claim is not None and not seq.claim.done:
            self.ctl.cancel(seq.claim)
        if seq.handle is not None:
            self.ctl.release(seq.handle)
        if keep_output:
            result = seq.result
            result.output_tokens = list(seq.generated)
            result.finish_reason = FinishReason.ABORT
        self._out.results.append(result)
