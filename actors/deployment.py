"""``Deployment``: the driver side of one TP x PP deployment.

:meth:`Deployment.launch` places the ranks (one bundle each, see :mod:`placement`), starts
one :class:`~actors.rank.RankActor` per rank in its bundle, has rank 0 bind the rendezvous
store and every rank join the groups. Requests go to rank 0 (:meth:`Deployment.generate`,
:meth:`Deployment.submit`, :meth:`Deployment.generate_async`), which checks each one once
(a named rank is a door of its own); a bad one gets its own error result. This door checks
what it alone knows (:func:`~actors.lifecycle.door`). Every rank runs them in lock step;
rank 0 answers with each request's result and cache statistics. States, recovery and
shutdown: :mod:`actors.lifecycle`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.forming import SLICE_S, RankSet
from actors.lifecycle import (
    Attempt,
    DeploymentError,
    DeploymentState,
    DeploymentStats,
    Reform,
    ReformFailed,
    at_caller,
    describe_failure,
    door,
    is_rank_failure,
    replay,
    send,
)
from actors.loop_thread import LoopThread
from actors.rank_group import check_launch
from actors.stats import RankHealth
from hicache_ray.engine.request import (
    GenerateRequest,
    RequestError,
    RequestResult,
    StreamChunk,
    check_batch,
    error_result,
)
from hicache_ray.engine.spec import DeploymentConfig
from placement.groups import StageGroups, acquire_groups, release_groups
from placement.plan import plan_stages

__all__ = ["Deployment", "DeploymentError", "DeploymentState", "Reform"]

log = logging.getLogger(__name__)

_POLL_S = 0.02  # how often wait_idle asks rank 0
# A retry refused as overloaded (every request in flight at a rank failure reaches the
# re-formed ranks at once) is offered again every 50 ms for 30 s (Attempt.refused).
_READMIT_S, _READMIT_TRIES = 0.05, 600


class Deployment(RankSet):
    """A running deployment; make one with :meth:`launch`, end it with :meth:`shutdown`."""

    def __init__(self, config: DeploymentConfig, groups: StageGroups) -> None:
        super().__init__(config, groups)
        self._io = LoopThread(f"hicache-{config.name}-io")  # runs the sync API's requests

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
            deployment._io.close()
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
        running: dict[int, Future[RequestResult]] = {}
        rids: set[str] = set()
        for i, raw in enumerate(batch):
            try:
                request = door(raw)
                rid = request.rid if type(request.rid) is str else None  # else rank 0 refuses it
                if rid is not None and rid in rids:
                    raise RequestError("rid", f"{rid!r} appears twice in this call")
            except RequestError as exc:
                results[i] = error_result(raw, str(exc))
                continue
            if rid is not None:
                rids.add(rid)
            running[i] = self._start(self._run(request))
        for i, future in running.items():
            results[i] = future.result()
        return [results[i] for i in range(len(batch))]

    def submit(self, request: GenerateRequest) -> Future[RequestResult]:
        """Run ``request`` in the background; the future holds its result."""
        return self._start(self.generate_async(request))

    def _start(self, coro: Coroutine[Any, Any, RequestResult]) -> Future[RequestResult]:
        """Run ``coro`` on the I/O loop; a shut-down deployment raises ``DeploymentError``."""
        try:
            self._check_open()
            return self._io.run(coro)
        except (DeploymentError, RuntimeError):  # RuntimeError: the loop has stopped
            coro.close()
            self._check_open()
            raise

    async def generate_async(self, request: GenerateRequest) -> RequestResult:
        """:meth:`generate` of one request for asyncio callers (a Serve replica)."""
        try:
            checked = door(request)
        except RequestError as exc:
            return error_result(request, str(exc))
        return await self._run(checked)

    async def _run(self, request: GenerateRequest) -> RequestResult:
        """A checked request to its result, through the one retry loop (:meth:`_attempts`)."""
        called, attempt = time.perf_counter(), Attempt()
        async for rank0 in self._attempts(attempt):
            try:
                for _ in range(_READMIT_TRIES):
                    try:
                        ref = send(rank0.generate, request)
                    except RequestError as exc:
                        return error_result(request, str(exc))
                    result: RequestResult = await self._get_async(ref)
                    if not attempt.refused(result):
                        break
                    await asyncio.sleep(_READMIT_S)
                # The caller sees the whole latency; what the rank did not spend of it went
                # to the calls, the inbox and re-forming (the first token's share of it).
                return at_caller(result, time.perf_counter() - called - result.latency_s)
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
            checked = door(request)
        except RequestError as exc:
            yield StreamChunk(tokens=[], result=error_result(request, str(exc)))
            return
        emitted: list[int] = []
        called, first_at, attempt = time.perf_counter(), 0.0, Attempt()
        async for rank0 in self._attempts(attempt):
            done = False
            try:
                seen = 0  # tokens of this run so far
                async for chunk in self._offered(rank0, checked, attempt):
                    fresh = replay(checked.rid, chunk.tokens, emitted, seen)
                    seen += len(chunk.tokens)
                    emitted += fresh
                    first_at = first_at or (time.perf_counter() if fresh else 0.0)
                    done = chunk.result is not None
                    result = chunk.result
                    if result is not None and first_at:
                        result = at_caller(result, first_at - called - result.ttft_s)
                    if fresh or done:
                        yield StreamChunk(tokens=fresh, result=result)
                    if done:
                        return
            except (RayActorError, RayTaskError) as exc:
                self._rank_failed(attempt, exc)
            except RequestError as exc:  # Ray could not send it
                done = True
                yield StreamChunk(tokens=[], result=error_result(checked, str(exc)))
                return
            finally:
                if not done and not self._closed.is_set() and attempt.cause is None:
                    rank0.abort.remote(checked.rid)  # the caller stopped listening

    async def _attempts(self, attempt: Attempt) -> AsyncIterator[Any]:
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
                serving = self._serving_now()
                if serving is None:  # broken or being re-formed: wait for it off the loop
                    serving = await loop.run_in_executor(self._executor, self._serving)
                generation, rank0 = serving
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

    def _rank_failed(self, attempt: Attempt, exc: RayActorError | RayTaskError) -> None:
        """Record a rank failure for the next attempt; re-raise any other error."""
        if not is_rank_failure(exc):
            raise exc
        self._check_open()
        attempt.cause = exc
        attempt.retried = True

    async def _offered(
        self, rank0: Any, request: GenerateRequest, attempt: Attempt
    ) -> AsyncIterator[StreamChunk]:
        """Chunks of ``request`` on ``rank0``; a refused retry is offered again (_READMIT_S)."""
        for _ in range(_READMIT_TRIES):
            chunks = self._chunks(send(rank0.generate_stream, request))
            first = await anext(chunks)
            if not attempt.refused(first.result):
                break
            await asyncio.sleep(_READMIT_S)
        yield first
        async for chunk in chunks:
            yield chunk

    async def _chunks(self, stream: Any) -> AsyncIterator[StreamChunk]:
        async for ref in stream:
            chunk: StreamChunk = await self._get_async(ref)
            yield chunk

    def abort(self, rid: str) -> None:
        """Stop request ``rid`` at the ranks' next step (its result says ``abort``)."""
        ranks = self._ranks()
        if ranks:
            ranks[0].abort.remote(rid)

    async def _get_async(self, ref: Any) -> Any:
        future = asyncio.wrap_future(ref.future())
        while True:
            done, _ = await asyncio.wait({future}, timeout=SLICE_S)
            if done:
                return future.result()
            self._check_open()

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
        # Calls still queued in the executor run and fail at once with "shut down"; so do
        # the requests on the I/O loop (at their next slice), after which it stops.
        self._executor.shutdown(wait=False)
        self._io.close()
