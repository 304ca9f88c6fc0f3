"""The per-rank step loop: admit, agree, take, prefill the uncached suffix, decode, insert.

Every rank of a deployment runs :meth:`RankRuntime.step` in lock step; rank 0 alone takes
:meth:`RankRuntime.submit` calls and reports results. One step:

1. rank 0's new requests are checked (a bad one gets an error result at once, alone) and
   admitted through the controller's step, which also agrees every fact of the step;
2. each request the prefetch policy lets run is taken with its agreed cached prefix (at
   most all but the last prompt token, which must be computed) and prefilled over it, the
   model waiting on each layer's load; its first token is sampled (greedy);
3. every running request decodes one token; a finished one inserts the KV of its prompt and
   generated tokens into the cache and releases its locks.

Requests waiting on a prefetch do not block the others: they are simply not runnable yet.

A request is checked (types, vocabulary, size) before it is admitted, so nothing invalid
reaches a collective. An exception raised while running one request (not a failed
collective) fails that request alone: every rank that raised agrees on it through
:meth:`CacheController.agree_failure` and goes on; a rank that did not raise never joins
that agreement, so the others time out and the deployment re-forms.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from hicache_ray.cache import CacheFullError, CacheHandle
from hicache_ray.controller import Arrival, CacheController
from hicache_ray.errors import CollectiveError
from hicache_ray.model import ReferenceModel
from hicache_ray.model.pipe import StagePipe, local_token
from hicache_ray.request import (
    GenerateRequest,
    RequestError,
    RequestResult,
    check_limits,
    check_request,
    error_result,
)

__all__ = ["GenerateRequest", "RankRuntime", "RequestResult"]

log = logging.getLogger(__name__)


class _Options(msgspec.Struct, frozen=True):
    """What an arrival carries besides its tokens (rank 0 encodes, every rank decodes)."""

    max_new_tokens: int


_OPTIONS = msgspec.msgpack.Decoder(_Options)


@dataclass
class _Running:
    request: GenerateRequest
    handle: CacheHandle
    result: RequestResult
    generated: list[int] = field(default_factory=list)


class RankRuntime:
    """One rank's scheduler over a cache controller and its share of the model.

    Args:
        controller: this rank's cache (its consensus group spans the deployment's ranks).
        model: this rank's share of the model (its TP shard of its PP stage's layers).
        pipe: moves hidden states between PP stages; None when one stage holds every layer.
        keep_logits: keep each request's first-token logits in ``first_logits`` (tests;
            the last PP stage only).
        reuse_prefix: take cached prefixes; False computes every prompt whole (the
            no-cache baseline of benchmarks; finished requests are still inserted).
    """

    def __init__(
        self,
        controller: CacheController,
        model: ReferenceModel,
        *,
        pipe: StagePipe | None = None,
        keep_logits: bool = False,
        reuse_prefix: bool = True,
    ) -> None:
        self.ctl = controller
        self.model = model
        self._forward = pipe.forward_token if pipe is not None else local_token
        self.busy = False  # whether the last step left work (requests, background copies)
        # Fault injection (tests, `bench faults`): called with the phase, "admit" (new
        # requests agreed, their prefetches started), "prefill" or "decode", and the request
        # id ("" for admit) before that work runs.
        self.on_phase: Callable[[str, str], None] | None = None
        self.page_size = controller.config.page_size
        self.keep_logits = keep_logits
        self.reuse_prefix = reuse_prefix
        self.first_logits: dict[str, torch.Tensor] = {}
        self._queue: list[object] = []
        self._requests: dict[str, tuple[GenerateRequest, float]] = {}  # admitted, not taken
        self._running: list[_Running] = []
        self._done: list[RequestResult] = []
        self._starting: tuple[str, CacheHandle] | None = None  # taken, not yet running

    # -------------------------------------------------------------- requests

    def submit(self, request: object) -> None:
        """Queue a request (rank 0); a bad one is answered with an error at the next step."""
        if self.ctl.consensus.rank != 0:
            raise ValueError("requests are submitted on rank 0")
        self._queue.append(request)

    def _check(self, request: object) -> GenerateRequest:
        """The request, checked; raises :class:`RequestError` naming what is wrong."""
        r = check_request(request)
        check_limits(r, self.model.config.vocab_size, self.ctl.cache.device_pool.num_tokens)
        if r.rid in self._requests or any(x.request.rid == r.rid for x in self._running):
            raise RequestError("rid", f"request id {r.rid!r} is already in flight")
        return r

    # ------------------------------------------------------------------ step

    @property
    def has_work(self) -> bool:
        """Requests queued, admitted or running on this rank."""
        return bool(self._queue or self._requests or self._running)

    @property
    def has_runnable_work(self) -> bool:
        """Requests to admit or to run now (not only requests waiting on prefetches)."""
        return bool(self._queue or self._running)

    def step(self) -> list[RequestResult]:
        """One scheduler iteration (every rank); returns the requests finished on it."""
        arrivals = []
        for queued in self._queue:
            try:
                r = self._check(queued)
            except RequestError as exc:
                self._done.append(error_result(queued, str(exc)))
                continue
            extra = msgspec.msgpack.encode(_Options(r.max_new_tokens))
            arrivals.append(Arrival(r.rid, r.tokens, extra))
        self._queue.clear()
        agreed = self.ctl.step(arrivals)
        if agreed.arrivals and self.on_phase is not None:
            self.on_phase("admit", "")
        now = time.perf_counter()
        for a in agreed.arrivals:
            try:
                options = _OPTIONS.decode(a.extra)
            except msgspec.DecodeError as exc:  # the same bytes on every rank: all refuse it
                self.ctl.cancel(a.rid)
                self._done.append(RequestResult(rid=a.rid, error=f"request options: {exc}"))
                continue
            self._requests[a.rid] = (GenerateRequest(a.rid, a.tokens, options.max_new_tokens), now)
        for ordinal, rid in enumerate(agreed.runnable):
            self._guarded(ordinal, rid, self._start)
        for ordinal, running in enumerate(list(self._running), start=len(agreed.runnable)):
            self._guarded(ordinal, running.request.rid, self._decode_rid)
        done, self._done = self._done, []
        # A request finished here started host writes the agreement has not seen yet.
        self.busy = agreed.busy or bool(done)
        return done

    def _guarded(self, ordinal: int, rid: str, work: Callable[[str], None]) -> None:
        """Run one request's work; its own failure fails it alone (see the module docstring)."""
        try:
            work(rid)
        except CollectiveError:
            raise
        except Exception as exc:
            log.exception("request %s failed on rank %d", rid, self.ctl.consensus.rank)
            self._drop(rid)
            self._done.append(RequestResult(rid=rid, error=f"{type(exc).__name__}: {exc}"))
            self.ctl.agree_failure(ordinal)

    def _drop(self, rid: str) -> None:
        """Forget a failed request and release whatever it held."""
        if rid in self._requests:
            del self._requests[rid]
            self.ctl.cancel(rid)
        for running in self._running:
            if running.request.rid == rid:
                self._running.remove(running)
                self.ctl.release(running.handle)
                return
        if self._starting is not None and self._starting[0] == rid:
            self.ctl.release(self._starting[1])
        self._starting = None

    def _start(self, rid: str) -> None:
        request, admitted = self._requests.pop(rid)
        taken = time.perf_counter()
        max_pages = (len(request.tokens) - 1) // self.page_size if self.reuse_prefix else 0
        handle = self.ctl.take(rid, max_pages=max_pages)
        self._starting = (rid, handle)  # released by _drop should anything below raise
        cached = handle.num_cached_tokens
        result = RequestResult(
            rid=rid,
            device_hit_tokens=handle.device_hit_tokens,
            host_hit_tokens=handle.host_hit_tokens,
            recomputed_tokens=len(request.tokens) - cached,
            prefetch_s=taken - admitted,
        )
        # Pages this request prefetched that another request already loaded to the device
        # are device hits for this one: L3 hits are the prefetched part of the host hit.
        result.storage_hit_tokens = min(handle.storage_hit_tokens, handle.host_hit_tokens)
        page_bytes = self.ctl.cache.kv.page_bytes
        result.load_bytes = handle.host_hit_tokens // self.page_size * page_bytes
        result.prefetch_bytes = handle.storage_hit_tokens // self.page_size * page_bytes
        loads = list(handle.loads)
        try:
            self.ctl.reserve(handle, len(request.tokens) - cached + request.max_new_tokens)
        except CacheFullError as exc:  # running requests hold the pool: this one fails alone
            self.ctl.release(handle)
            self._starting = None
            self._done.append(RequestResult(rid=rid, error=str(exc)))
            return
        ids = torch.tensor(request.tokens[cached:])
        if self.on_phase is not None:
            self.on_phase("prefill", rid)
        with self.ctl.computing():
            token, logits = self._forward(
                self.model,
                ids,
                self.ctl.cache.device_pool,
                handle.device_pages,
                cached,
                wait_layer=handle.wait_layer,
            )
        self.ctl.wait_ready(handle)  # surfaces (and counts) a failed load
        result.load_s = max((t.latency_s or 0.0 for t in loads), default=0.0)
        if self.keep_logits and logits is not None:
            self.first_logits[rid] = logits.clone()
        running = _Running(request, handle, result)
        result.ttft_s = time.perf_counter() - admitted
        if request.max_new_tokens:
            running.generated.append(token)
        self._running.append(running)
        self._starting = None
        self._maybe_finish(running)

    def _decode_rid(self, rid: str) -> None:
        self._decode(next(r for r in self._running if r.request.rid == rid))

    def _decode(self, running: _Running) -> None:
        if self._maybe_finish(running):
            return
        request = running.request
        position = len(request.tokens) + len(running.generated) - 1
        if self.on_phase is not None:
            self.on_phase("decode", request.rid)
        token, _ = self._forward(
            self.model,
            torch.tensor(running.generated[-1:]),
            self.ctl.cache.device_pool,
            running.handle.device_pages,
            position,
        )
        running.generated.append(token)
        self._maybe_finish(running)

    def _maybe_finish(self, running: _Running) -> bool:
        if len(running.generated) < running.request.max_new_tokens:
            return False
        # KV exists for the prompt and every generated token but the last.
        tokens = running.request.tokens + running.generated[:-1]
        self.ctl.finish(running.handle, tokens)
        running.result.output_tokens = list(running.generated)
        self._running.remove(running)
        self._done.append(running.result)
        return True
