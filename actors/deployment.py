"""``Deployment``: the driver side of one TP x PP deployment.

:meth:`Deployment.launch` places the ranks (one bundle each, see :mod:`placement`), starts
one :class:`~actors.rank.RankActor` per rank in its bundle, has rank 0 bind the rendezvous
store and every rank join the groups. Requests go to rank 0 (:meth:`Deployment.generate`,
:meth:`Deployment.submit`, :meth:`Deployment.generate_async`) once they passed
:func:`~hicache_ray.request.check_request` here: a bad request gets its own error result and
never reaches a rank. Every rank runs them in lock step; rank 0 answers with each request's
result and cache statistics.

States, recovery and shutdown are described in :mod:`actors.lifecycle`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actors.lifecycle import (
    DeploymentError,
    DeploymentState,
    DeploymentStats,
    Reform,
    ReformFailed,
    describe_failure,
    is_rank_failure,
    replay,
)
from actors.rank_group import check_launch, find_suspects, kill_ranks, start_ranks, stop_ranks
from hicache_ray.request import (
    GenerateRequest,
    RequestError,
    RequestResult,
    StreamChunk,
    check_batch,
    check_limits,
    check_request,
    error_result,
)
from hicache_ray.spec import DeploymentConfig
from hicache_ray.stats import RankHealth
from placement.groups import StageGroups, acquire_groups, release_groups
from placement.plan import plan_stages

__all__ = ["Deployment", "DeploymentError", "DeploymentState", "Reform"]

log = logging.getLogger(__name__)

_POLL_S = 0.02  # how often wait_idle asks rank 0
_SLICE_S = 0.5  # a wait on the request path checks for shutdown this often


class Deployment:
    """A running deployment; make one with :meth:`launch`, end it with :meth:`shutdown`."""

    def __init__(self, config: DeploymentConfig, groups: StageGroups) -> None:
        self.config = config
        self.groups = groups
        self.generation = 0
        self.state = DeploymentState.FORMING
        self.reforms: list[Reform] = []  # guarded by _lock
        self.ranks: list[Any] = []  # guarded by _lock
        self._broken: str | None = None  # guarded by _lock: why the last re-forming failed
        self._lock = threading.RLock()  # serializes forming, re-forming and shutdown
        self._closed = threading.Event()
        self._executor = ThreadPoolExecutor(32, thread_name_prefix=f"hicache-{config.name}")

    @classmethod
    def launch(cls, config: DeploymentConfig) -> Deployment:
        """Place and start the ranks; returns once every rank is stepping.

        Raises:
            ConfigError: a deployment of ``config.name`` is running, or the ``ray`` L3
                store exists with another shard count (nothing was created).
            PlacementError: the cluster cannot hold the ranks within the placement timeout.
            DeploymentError: a rank failed to start (the cause is attached).
        """
        stages = plan_stages(
            config.tp_size,
            config.pp_size,
            cpus_per_rank=config.cpus_per_rank,
            gpus_per_rank=config.gpus_per_rank,
            resources=config.bundle_resources,
            nodes=[n["Resources"] for n in ray.nodes() if n["Alive"]],  # type: ignore[no-untyped-call]
        )
        if config.cache.storage.backend != "none":
            log.info("deployment %s: %s", config.name, config.sharing())
        check_launch(config)
        groups = acquire_groups(stages, timeout_s=config.placement_timeout_s, name=config.name)
        deployment = cls(config, groups)
        try:
            with deployment._lock:
                deployment._form()
                deployment.state = DeploymentState.SERVING
        except BaseException:
            release_groups(groups)
            deployment._executor.shutdown(wait=False)
            raise
        return deployment

    # ------------------------------------------------------------- requests

    def generate(self, requests: Sequence[GenerateRequest]) -> list[RequestResult]:
        """Run ``requests`` (at once) and return their results in the same order.

        A bad request gets an error result (``field: problem``) and the others are served.

        Raises:
            TypeError: ``requests`` is not a sequence.
            DeploymentError: the deployment is shut down, or a request still failed after
                ``max_retries`` retries (re-formings).
        """
        batch = check_batch(requests)
        results: dict[int, RequestResult] = {}
        pending: list[tuple[int, GenerateRequest]] = []
        rids: set[str] = set()
        for i, raw in enumerate(batch):
            try:
                request = self._check(raw)
                if request.rid in rids:
                    raise RequestError("rid", f"{request.rid!r} appears twice in this call")
            except RequestError as exc:
                results[i] = error_result(raw, str(exc))
                continue
            rids.add(request.rid)
            pending.append((i, request))
        cause: BaseException | None = None
        for attempt in range(self.config.max_retries + 1):
            if not pending:
                break
            try:
                generation, rank0 = self._serving()
            except ReformFailed as exc:
                cause = exc.__cause__ or exc
                continue
            refs = [rank0.generate.remote(r) for _, r in pending]
            failed = []
            for (i, request), ref in zip(pending, refs, strict=True):
                try:
                    results[i] = self._get(ref)
                except (RayActorError, RayTaskError) as exc:
                    if not is_rank_failure(exc):
                        raise
                    self._check_open()
                    failed.append((i, request))
                    cause = exc
            pending = failed
            if pending and attempt < self.config.max_retries:
                try:
                    self._reform(generation, cause)
                except ReformFailed as exc:
                    cause = exc.__cause__ or exc
            elif pending:
                self._mark_broken(generation, cause)
        if pending:
            raise DeploymentError(
                f"{len(pending)} request(s) failed after {self.config.max_retries} retries: "
                f"{describe_failure(cause)}"
            ) from cause
        return [results[i] for i in range(len(batch))]

    def submit(self, request: GenerateRequest) -> Future[RequestResult]:
        """Run ``request`` in the background; the future holds its result."""
        return self._executor.submit(lambda: self.generate([request])[0])

    async def generate_async(self, request: GenerateRequest) -> RequestResult:
        """:meth:`generate` of one request for asyncio callers (a Serve replica)."""
        try:
            checked = self._check(request)
        except RequestError as exc:
            return error_result(request, str(exc))
        attempt = _Attempt()
        async for rank0 in self._attempts(attempt):
            try:
                result: RequestResult = await self._get_async(rank0.generate.remote(checked))
                return result
            except (RayActorError, RayTaskError) as exc:
                self._rank_failed(attempt, exc)
        raise AssertionError("unreachable: _attempts raises when no retry is left")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Run ``request``, yielding its tokens as the ranks make them, then a last chunk with
        its result. After a rank failure the request runs again in the re-formed ranks and
        the tokens already yielded are not yielded twice (runs are deterministic: greedy,
        or seeded). Closing the iterator early aborts the request.

        Raises:
            DeploymentError: shut down, a retried run diverged, or no retry left.
        """
        try:
            checked = self._check(request)
        except RequestError as exc:
            yield StreamChunk(tokens=[], result=error_result(request, str(exc)))
            return
        emitted: list[int] = []
        attempt = _Attempt()
        async for rank0 in self._attempts(attempt):
            done = False
            try:
                seen = 0  # tokens of this run so far
                async for chunk in self._chunks(rank0.generate_stream.remote(checked)):
                    fresh = replay(checked.rid, chunk.tokens, emitted, seen)
                    seen += len(chunk.tokens)
                    emitted += fresh
                    done = chunk.result is not None
                    if fresh or done:
                        yield StreamChunk(tokens=fresh, result=chunk.result)
                    if done:
                        return
            except (RayActorError, RayTaskError) as exc:
                self._rank_failed(attempt, exc)
            finally:
                if not done and not self._closed.is_set() and attempt.cause is None:
                    rank0.abort.remote(checked.rid)  # the caller stopped listening

    async def _attempts(self, attempt: _Attempt) -> AsyncIterator[Any]:
        """The retry loop of one asyncio request: rank 0 of each attempt. A caller whose
        attempt hit a rank failure records it (:meth:`_rank_failed`) and asks for the next
        one, which re-forms first; a caller that got its answer stops asking.

        Raises:
            DeploymentError: shut down, or no retry left.
        """
        loop = asyncio.get_running_loop()
        for n in range(self.config.max_retries + 1):
            self._check_open()
            try:
                generation, rank0 = await loop.run_in_executor(self._executor, self._serving)
            except ReformFailed as exc:
                attempt.cause = exc.__cause__ or exc
                continue
            attempt.cause = None
            yield rank0
            if n < self.config.max_retries:
                self._check_open()
                try:
                    await loop.run_in_executor(
                        self._executor, self._reform, generation, attempt.cause
                    )
                except ReformFailed as exc:
                    attempt.cause = exc.__cause__ or exc
            else:
                self._mark_broken(generation, attempt.cause)
        raise DeploymentError(
            f"request failed after {self.config.max_retries} retries: "
            f"{describe_failure(attempt.cause)}"
        ) from attempt.cause

    def _rank_failed(self, attempt: _Attempt, exc: RayActorError | RayTaskError) -> None:
        """Record a rank failure for the next attempt; re-raise any other error."""
        if not is_rank_failure(exc):
            raise exc
        self._check_open()
        attempt.cause = exc

    async def _chunks(self, stream: Any) -> AsyncIterator[StreamChunk]:
        async for ref in stream:
            chunk: StreamChunk = await self._get_async(ref)
            yield chunk

    def abort(self, rid: str) -> None:
        """Stop request ``rid`` at the ranks' next step (its result says ``abort``)."""
        ranks = self._ranks()
        if ranks:
            ranks[0].abort.remote(rid)

    def _check(self, request: object) -> GenerateRequest:
        checked = check_request(request)
        capacity = self.config.cache.memory.num_device_pages * self.config.cache.page_size
        model = self.config.model
        check_limits(checked, model.vocab_size, capacity, model.max_context)
        return checked

    # ------------------------------------------------------------ inspection

    def stats(self) -> DeploymentStats:
        """Every rank's statistics plus the deployment's shape, state and re-formings."""
        ranks = self._ranks()
        answers = ray.get([r.stats.remote() for r in ranks], timeout=30) if ranks else []
        return DeploymentStats(
            name=self.config.name,
            state=self.state.value,
            tp_size=self.config.tp_size,
            pp_size=self.config.pp_size,
            generation=self.generation,
            reforms=list(self.reforms),
            ranks=answers,
        )

    def health(self, timeout_s: float = 10.0) -> list[RankHealth]:
        """Per rank: whether it answers and is stepping, its step count and last error.
        Without ranks (broken or shut down) every rank says why."""
        ranks = self._ranks()
        if not ranks:
            why = f"deployment is {self.state.value}" + (
                f": {self._broken}" if self._broken else ""
            )
            return [RankHealth(rank=r, error=why) for r in range(self.config.world_size)]
        refs = [actor.health.remote() for actor in ranks]
        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except Exception as exc:
                out.append(RankHealth(rank=rank, generation=self.generation, error=repr(exc)))
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Block until no request is in flight, every rank's background work (host
        writes, prefetches, L3 backups) is done and acknowledged, and the pages stored in
        L3 outlive the ranks (a store that copies them in the background has done so).

        Raises:
            TimeoutError: still busy after ``timeout_s``.
            DeploymentError: the deployment has no ranks (broken or shut down).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            ranks = self._ranks()
            if not ranks:
                raise DeploymentError(f"deployment {self.config.name!r} is {self.state.value}")
            left = max(0.1, deadline - time.monotonic())
            if ray.get(ranks[0].idle.remote(), timeout=left):
                ray.get([r.flush_storage.remote() for r in ranks], timeout=left)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"deployment {self.config.name!r} still busy after {timeout_s}s")
            time.sleep(_POLL_S)

    def shutdown(self) -> None:
        """Stop accepting requests, fail those in flight, stop and kill every rank, and
        release the placement groups this deployment made. Safe to call twice."""
        self._closed.set()
        with self._lock:  # an ongoing (re-)forming sees _closed and gives up first
            if self.state is DeploymentState.SHUT_DOWN:
                return
            self.state = DeploymentState.SHUT_DOWN
            self._stop_ranks()
        release_groups(self.groups)
        # Calls still queued in the executor run and fail at once with "shut down".
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------- forming

    def _ranks(self) -> list[Any]:
        with self._lock:
            return list(self.ranks)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise DeploymentError(f"deployment {self.config.name!r} was shut down")

    def _serving(self) -> tuple[int, Any]:
        """The generation and rank 0 to send requests to; re-forms a broken deployment.

        Raises:
            DeploymentError: shut down.
            ReformFailed: the deployment was broken and re-forming it failed again.
        """
        with self._lock:
            self._check_open()
            if self.state is DeploymentState.BROKEN:
                self._reform(self.generation, None)
            return self.generation, self.ranks[0]

    def _get(self, ref: Any) -> Any:
        """``ray.get`` in slices that each check for shutdown."""
        while True:
            try:
                return ray.get(ref, timeout=_SLICE_S)
            except GetTimeoutError:
                self._check_open()

    async def _get_async(self, ref: Any) -> Any:
        future = asyncio.wrap_future(ref.future())
        while True:
            done, _ = await asyncio.wait({future}, timeout=_SLICE_S)
            if done:
                return future.result()
            self._check_open()

    def _wait_all(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """Results of ``refs``; fails as soon as one fails, on shutdown, or at the deadline."""
        deadline = time.monotonic() + timeout_s
        left = list(refs)
        while left:
            self._check_open()
            budget = deadline - time.monotonic()
            if budget <= 0:
                raise TimeoutError(f"{len(left)} rank(s) did not answer within {timeout_s:g}s")
            ready, left = ray.wait(left, num_returns=1, timeout=min(_SLICE_S, budget))
            for ref in ready:
                ray.get(ref)  # raises the rank's error at once
        return ray.get(refs)

    def _form(self) -> None:
        """Start generation ``self.generation``'s ranks and join them (caller holds the lock)."""
        cfg = self.config
        self.ranks = start_ranks(cfg, self.groups, self.generation)
        timeout = cfg.placement_timeout_s + cfg.consensus_timeout_s
        try:
            host, port = self._wait_all([self.ranks[0].start_rendezvous.remote()], timeout)[0]
            self._wait_all([r.join.remote(host, port) for r in self.ranks], timeout)
        except Exception as exc:
            self._kill_ranks()
            if isinstance(exc, DeploymentError):
                raise
            raise DeploymentError(
                f"deployment {cfg.name!r} (TP={cfg.tp_size}, PP={cfg.pp_size}) did not form: "
                f"{describe_failure(exc)}"
            ) from exc
        log.info("deployment %s formed (generation %d)", cfg.name, self.generation)

    def _reform(self, seen_generation: int, cause: BaseException | None) -> None:
        """Replace every rank (once per failure, however many callers saw it).

        Raises:
            DeploymentError: the deployment was shut down.
            ReformFailed: the new ranks did not form (the deployment is left broken; the
                next call re-forms again).
        """
        with self._lock:
            self._check_open()
            if self.generation != seen_generation and self.state is DeploymentState.SERVING:
                return  # another caller already re-formed after this failure
            started = time.monotonic()
            why = describe_failure(cause) if cause is not None else f"broken: {self._broken}"
            if self.ranks:
                suspects = find_suspects(self.ranks, self.config.consensus_timeout_s)
                why += f"; suspects: {', '.join(suspects) or 'none found'}"
            log.warning("deployment %s: re-forming after %s", self.config.name, why)
            self.state = DeploymentState.REFORMING
            self._kill_ranks()
            self.generation += 1
            try:
                self._form()
            except DeploymentError as exc:
                seconds = time.monotonic() - started
                if self._closed.is_set():
                    raise
                self.state = DeploymentState.BROKEN
                self._broken = str(exc)
                self.reforms.append(
                    Reform(
                        generation=self.generation,
                        cause=why,
                        seconds=seconds,
                        ok=False,
                        error=str(exc),
                    )
                )
                log.error("deployment %s: re-forming failed: %s", self.config.name, exc)
                raise ReformFailed(str(exc)) from exc
            self.state = DeploymentState.SERVING
            self._broken = None
            self.reforms.append(
                Reform(generation=self.generation, cause=why, seconds=time.monotonic() - started)
            )

    def _mark_broken(self, seen_generation: int, cause: BaseException | None) -> None:
        """A failure no retry is left for: stop the failed ranks now (the next call
        re-forms), so that nothing is sent to them meanwhile."""
        with self._lock:
            if self.generation != seen_generation or self.state is not DeploymentState.SERVING:
                return
            self.state = DeploymentState.BROKEN
            self._broken = describe_failure(cause)
            log.warning("deployment %s: broken by %s", self.config.name, self._broken)
            self._kill_ranks()

    def _stop_ranks(self) -> None:
        """Stop the step loops (failing what is pending), then kill the ranks."""
        ranks, self.ranks = self.ranks, []
        stop_ranks(ranks, self.config.name)

    def _kill_ranks(self) -> None:
        kill_ranks(self.ranks)
        self.ranks = []


class _Attempt:
    """What one asyncio request's current attempt failed with (None: nothing yet)."""

    __slots__ = ("cause",)

    def __init__(self) -> None:
        self.cause: BaseException | None = None
