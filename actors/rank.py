"""``RankActor``: one rank of a deployment, a thin wrapper over :class:`RankRuntime`.

Life of an actor: :meth:`RankActor.start_rendezvous` (rank 0: bind the TCP store on port
0), :meth:`RankActor.join` (every rank at once: :func:`~hicache_ray.engine.compose.compose_rank`
builds the groups, the controller, the model shard and the runtime; then the step loop
starts), :meth:`RankActor.stop`.
The :class:`~hicache_ray.engine.step_loop.StepLoop` runs :meth:`RankRuntime.step` in lock step with
the other ranks; rank 0 feeds it the requests that :meth:`RankActor.generate` receives and
resolves each caller's future with its result. Idle, rank 0 still steps every
``idle_step_s`` (the others wait in the collective), so the consensus timeout only fires
when a rank is really gone or stalled.

When a step fails (a peer died, a collective timed out), the loop ends, records why, and
fails every pending request with :class:`RankFailure`; the driver's
:class:`~actors.deployment.Deployment` then re-forms the ranks and retries them. A stopped
rank (``stop``) fails them with a ``RankFailure`` saying so, and stays quiet about the
collectives its peers break on their way down.

Threads: the event loop (``generate`` and the inspection calls), the step loop, and Ray's
thread pool for ``join``. ``_lock`` guards ``_inbox``, ``_waiters`` and ``_stopped``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from actors.event_poll import FlushWatch
from actors.faults import FaultHooks, RankFault
from actors.metrics import StatsPublisher
from actors.stats import RankHealth, RankStats, loop_health
from actors.waiter import Waiter
from hicache_ray.base.affinity import pin_process
from hicache_ray.base.errors import HiCacheError
from hicache_ray.cache.controller import CacheController, start_rendezvous
from hicache_ray.cache.controller.consensus import Rendezvous
from hicache_ray.cache.events import EventBatch, check_position, check_wait
from hicache_ray.engine.compose import RankPlace, compose_rank, rank_device
from hicache_ray.engine.hint_channel import HintReceiver, open_hints
from hicache_ray.engine.request import (
    GenerateRequest,
    RequestError,
    RequestResult,
    StreamChunk,
    check_request,
    error_result,
)
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.engine.step_loop import StepLoop

__all__ = ["RankActor", "RankFailure"]

log = logging.getLogger(__name__)

_BUSY_STEP_S = 0.005  # background work pending (copies, backups): step this often
_WAITING_STEP_S = 0.02  # requests wait on this rank's prefetches: step at most this often
_PEER_STEP_S = 0.003  # requests wait on the other ranks' prefetches: step this often
_PUBLISH_EVERY_S = 1.0


def _freeze_startup_objects() -> None:
    """Keep what start-up made (modules, the model, the pools: about 220,000 objects in a
    `bench` rank) out of every later garbage collection.

    A full collection walks every tracked object: 130-175 ms in a rank. In a probe of fresh
    TP=2 deployments the allocations of one L3 hit set one off in the middle of its reads,
    on both ranks at once (py-spy: ``gc_collect_main`` under Ray's deserialisation), and the
    reads took 230-330 ms instead of 63-106. Frozen objects are never collected, and
    start-up's live as long as the process (vLLM's engine freezes its own the same way).
    """
    gc.collect()
    gc.freeze()


class RankFailure(HiCacheError, RuntimeError):
    """The ranks of a deployment stopped stepping (a rank died, stalled, raised or was
    stopped)."""


class RankActor:
    """One rank (the Deployment makes it a Ray actor in its bundle)."""

    def __init__(self, config: DeploymentConfig, rank: int, generation: int = 0) -> None:
        # The L3 client's ray.get calls run on the step and join threads, never on the
        # event loop; Ray warns about any ray.get in an async actor.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")

        pin_process(config.cpu_cores)  # before torch starts threads of its own
        torch.set_num_threads(max(1, int(config.cpus_per_rank)))
        self.config = config
        self.rank = rank
        self.generation = generation
        self.device = rank_device(config)
        self._rendezvous: Rendezvous | None = None
        self.controller: CacheController | None = None
        self.runtime: RankRuntime | None = None
        self._lock = threading.Lock()
        self._inbox: list[GenerateRequest] = []  # guarded by _lock
        self._abort_inbox: list[str] = []  # guarded by _lock
        self._waiters: dict[str, Waiter] = {}  # guarded by _lock
        self._stopped: str | None = None  # guarded by _lock: why no request is taken
        self._loop: StepLoop | None = None
        self._hints: HintReceiver | None = None  # ranks 1...: rank 0's look-ahead hints
        self.error: str | None = None
        self.model_backend = ""  # gloo or nccl, once the groups are joined
        self._publisher = StatsPublisher(config.name, rank)
        self._published_at = 0.0
        self._faults: FaultHooks | None = None  # none unless a test injects one
        self._flushes = FlushWatch()  # cache_events' long polls

    # --------------------------------------------------------------- forming

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def start_rendezvous(self) -> tuple[str, int]:
        """Rank 0: bind the store every group of this deployment meets on."""
        import ray

        host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._rendezvous = start_rendezvous(
            self.config.world_size, host, timeout_s=self.config.consensus_timeout_s
        )
        return host, self._rendezvous.port

    async def join(self, host: str, port: int) -> None:
        """Build the groups, the cache and the model; start stepping. (Off the event loop:
        joining blocks until every rank joined, and the L3 client makes Ray calls.)"""
        await asyncio.get_running_loop().run_in_executor(None, self._join, host, port)

    def _join(self, host: str, port: int) -> None:
        at = RankPlace(self.rank, self.device, (host, port), self._rendezvous, self.generation)
        composed = compose_rank(self.config, at)
        self.model_backend = composed.model_backend
        self.controller, self.runtime = composed.controller, composed.runtime
        _freeze_startup_objects()
        self._loop = StepLoop(
            self._step, pace=self._pace, on_error=self._stopped_by, name=f"hicache-rank{self.rank}"
        )
        if self.controller.prefetch is not None:  # a prefetch's end starts the next step
            self.controller.prefetch.on_progress(self._loop.wake)
            self._hints = open_hints((host, port), self.rank, self.config, composed.runtime)
        self._loop.start()

    # -------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> RequestResult:
        """Rank 0: run ``request`` to completion; raises :class:`RankFailure` when the
        ranks stopped stepping before it finished (or were stopped)."""
        waiter = self._enqueue(request, stream=False)
        if isinstance(waiter, RequestResult):
            return waiter
        result: RequestResult = await waiter.future
        return result

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Rank 0: run ``request``, yielding its tokens as each step makes them, then a
        last chunk with its result; raises :class:`RankFailure` like :meth:`generate`."""
        waiter = self._enqueue(request, stream=True)
        if isinstance(waiter, RequestResult):
            yield StreamChunk(tokens=[], result=waiter)
            return
        assert waiter.chunks is not None
        while True:
            chunk = await waiter.chunks.get()
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk
            if chunk.result is not None:
                return

    def abort(self, rid: str) -> None:
        """Rank 0: stop request ``rid`` at the next step (its result says ``abort``)."""
        with self._lock:
            self._abort_inbox.append(rid)
        if self._loop is not None:
            self._loop.wake()

    def _enqueue(self, request: object, *, stream: bool) -> Waiter | RequestResult:
        if self.rank != 0:
            raise ValueError("requests go to rank 0")
        try:  # a named actor is a door of its own: anyone on the cluster can call it
            rt = self.runtime
            checked = rt.check(request) if rt is not None else check_request(request)
        except RequestError as exc:
            return error_result(request, str(exc))
        loop = asyncio.get_running_loop()
        waiter = Waiter(loop, loop.create_future(), asyncio.Queue() if stream else None)
        with self._lock:
            if self._stopped is not None:
                raise RankFailure(f"rank {self.rank} stopped: {self._stopped}")
            if checked.rid in self._waiters:
                in_flight = f"rid: request id {checked.rid!r} is already in flight"
                return error_result(checked, in_flight)
            self._waiters[checked.rid] = waiter
            self._inbox.append(checked)
        if self._loop is not None:
            self._loop.wake()
        return waiter

    def stop(self, reason: str = "the deployment was shut down", timeout_s: float = 10.0) -> bool:
        """Stop taking requests, fail the pending ones, stop the step loop after its current
        step; returns whether the loop ended within ``timeout_s`` (a rank blocked in a
        collective ends only when its peers stop or die)."""
        self._fail_pending(reason)
        if self._hints is not None:
            self._hints.close()
        if self._loop is None:
            return True
        return self._loop.stop(timeout_s)

    def request_stop(self) -> None:
        """Mark the step loop as stopping (without waiting), so that the collectives its
        stopping peers break are expected, not failures."""
        if self._loop is not None:
            self._loop.request_stop()

    # ------------------------------------------------------------ inspection

    def stats(self) -> RankStats:
        """This rank's controller and storage statistics."""
        out = RankStats(
            rank=self.rank,
            error=self.error,
            device=str(self.device),
            model_backend=self.model_backend,
        )
        if self.controller is not None:
            out.controller = self.controller.stats()
            if self.controller.storage is not None:
                out.storage = self.controller.storage.stats()
        return out

    def health(self) -> RankHealth:
        """Whether the step loop runs, its step count and error, and where it is: inside a
        step (possibly waiting in a collective) or for how long it has been outside one."""
        return loop_health(self.rank, self.generation, self._loop, self.error)

    def idle(self) -> bool:
        """Rank 0: no request in flight and, as of the last step, no rank has background
        work (host writes, prefetches, backups) left."""
        rt = self.runtime
        with self._lock:
            inbox = bool(self._inbox)
        return rt is not None and not (inbox or rt.has_work or rt.busy)

    async def cache_events(
        self, epoch: str, seq: int, wait_s: float = 0.0
    ) -> list[EventBatch] | None:
        """Rank 0: the cache-event batches after batch ``seq`` of journal ``epoch``; None
        when the caller must take :meth:`cache_snapshot` instead (another journal: this
        generation's is new; or batches no longer kept). None new yet: waits up to
        ``wait_s`` for the next (a long poll, :mod:`actors.event_poll`)."""
        epoch, seq = check_position(epoch, seq)  # a named actor: anyone can call it
        wait_s = check_wait(wait_s)
        events = self.controller.events if self.controller is not None else None
        if events is None or epoch != events.epoch:
            return None
        await self._flushes.wait(events, seq, wait_s)
        return events.since(seq)

    def cache_snapshot(self) -> EventBatch:
        """Rank 0: what the tree holds now, as one batch of cache events (between steps)."""
        assert self.controller is not None and self.controller.events is not None
        snapshot: EventBatch = self._between_steps(self.controller.events.snapshot)
        return snapshot

    def flush_storage(self) -> None:
        """Wait until the L3 pages this rank stored so far outlive it (see the backend)."""
        if self.controller is not None and self.controller.storage is not None:
            self.controller.storage.flush()

    def inject(self, fault: RankFault) -> None:
        """Fault injection (tests, ``bench faults``): see :class:`~actors.faults.RankFault`.

        Raises:
            ValueError: a fault that cannot be injected.
        """
        if not isinstance(fault, RankFault):
            raise ValueError(f"expected a RankFault, got {type(fault).__name__}")
        if self._faults is None:
            self._faults = FaultHooks(self.rank)
        self._faults.add(fault)
        if fault.kind != "pause":
            assert self.runtime is not None
            self.runtime.on_phase = self._faults.on_phase

    def check_integrity(self) -> None:
        """The cache's invariants, checked between two steps."""
        if self.controller is not None:
            self._between_steps(self.controller.check_integrity)

    def evict_all(self) -> dict[str, int]:
        """Between two steps: evict every unlocked page; the pages still in use (none
        after a drain, unless locks leaked) and the cache's invariants checked."""
        assert self.controller is not None
        controller = self.controller

        def evict() -> dict[str, int]:
            device, host = controller.cache.evict_all()
            controller.check_integrity()
            return {"device_pages_used": device, "host_pages_used": host}

        result: dict[str, int] = self._between_steps(evict)
        return result

    def _between_steps(self, chore: Any, timeout_s: float = 60.0) -> Any:
        """Run ``chore`` on the step thread between two steps (it owns the cache)."""
        if self._loop is None:
            return chore()
        return self._loop.between_steps(chore, timeout_s)

    # ------------------------------------------------------------- stepping

    def _pace(self) -> float:
        """Seconds the step loop waits before the next step (rank 0 sets the pace; the
        others follow it, waiting in the step's collectives)."""
        if self._faults is not None:  # stall outside the step, as a hung rank would
            self._faults.before_step()
        rt = self.runtime
        if self.rank != 0 or rt is None:
            return 0.0
        with self._lock:
            inbox = bool(self._inbox or self._abort_inbox)
        if inbox or rt.has_runnable_work:
            return 0.0
        if rt.has_work:
            # Admitted requests wait on prefetches. While this rank's own queries or reads
            # run, their end wakes the loop; once they are done the requests wait on the
            # other ranks' (whose end cannot wake rank 0): ask again soon.
            return _WAITING_STEP_S if rt.ctl.prefetching else _PEER_STEP_S
        return _BUSY_STEP_S if rt.busy else self.config.idle_step_s

    def _step(self) -> None:
        rt = self.runtime
        assert rt is not None
        if self.rank == 0:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._abort_inbox = self._abort_inbox, []
            for request in inbox:
                rt.enqueue(request)  # checked by _enqueue
            for rid in aborts:
                rt.abort(rid)
        started = time.monotonic()
        out = rt.step()
        now = time.monotonic()
        self._publisher.observe_step(now - started)
        if out.tokens and self.rank == 0:
            self._stream(out.tokens)
        for result in out.results:
            if self.rank == 0:
                self._publisher.observe_result(result)
            self._resolve(result)
        if now - self._published_at >= _PUBLISH_EVERY_S and self.controller is not None:
            self._published_at = now
            queued = rt.num_queued if self.rank == 0 else None
            self._publisher.publish(self.controller.stats(), queued)

    def _stopped_by(self, exc: BaseException) -> None:
        """On the step thread: the loop ended because a step raised."""
        self.error = f"{type(exc).__name__}: {exc}"
        log.error("rank %d stopped stepping: %s", self.rank, self.error, exc_info=exc)
        self._fail_pending(self.error)

    def _fail_pending(self, reason: str) -> None:
        with self._lock:
            if self._stopped is None:
                self._stopped = reason
            waiters, self._waiters = self._waiters, {}
        failure = RankFailure(f"rank {self.rank} stopped: {reason}")
        for waiter in waiters.values():
            waiter.loop.call_soon_threadsafe(waiter.fail, failure)

    def _stream(self, tokens: dict[str, list[int]]) -> None:
        with self._lock:
            streams = [(self._waiters.get(rid), new) for rid, new in tokens.items()]
        for waiter, new in streams:
            if waiter is not None and waiter.chunks is not None:
                waiter.loop.call_soon_threadsafe(waiter.chunks.put_nowait, StreamChunk(tokens=new))

    def _resolve(self, result: RequestResult) -> None:
        with self._lock:
            waiter = self._waiters.pop(result.rid, None)
        if waiter is not None:
            waiter.loop.call_soon_threadsafe(waiter.succeed, result)
