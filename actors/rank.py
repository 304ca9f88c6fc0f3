"""``RankActor``: one rank of a deployment, a thin wrapper over :class:`RankRuntime`.

Life of an actor: :meth:`RankActor.start_rendezvous` (rank 0: bind the TCP store on port
0), :meth:`RankActor.join` (every rank at once: the cache-consensus group over every rank,
its stage's TP group for the model, and with PP a group for the stage pipe; then the
controller, the model shard, the runtime, and the step thread). The step thread runs
:meth:`RankRuntime.step` in lock step with the other ranks; rank 0 feeds it the requests
that :meth:`RankActor.generate` receives and resolves each caller's future with its
result. Idle, rank 0 still steps every ``idle_step_s`` (the others wait in the collective),
so the consensus timeout only fires when a rank is really gone or stalled.

When a step fails (a peer died, a collective timed out, a rank raised), the thread stops,
records why, and fails every pending request with :class:`RankFailure`; the driver's
:class:`~actors.deployment.Deployment` then re-forms the ranks and retries them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from actors.metrics import StatsPublisher
from actors.spec import DeploymentConfig
from hicache_ray.controller import CacheController, GlooConsensus, start_rendezvous
from hicache_ray.controller.consensus import Rendezvous
from hicache_ray.errors import HiCacheError
from hicache_ray.layout import Shard, ShardKV
from hicache_ray.model import ReferenceModel, gloo_tp_all_reduce
from hicache_ray.model.pipe import StagePipe
from hicache_ray.runtime import GenerateRequest, RankRuntime, RequestResult

__all__ = ["RankActor", "RankFailure"]

log = logging.getLogger(__name__)

_BUSY_STEP_S = 0.002  # background work pending (copies, backups): step this often
_PUBLISH_EVERY_S = 1.0


class RankFailure(HiCacheError, RuntimeError):
    """The ranks of a deployment stopped stepping (a rank died, stalled or raised)."""


class RankActor:
    """One rank (the Deployment makes it a Ray actor in its bundle)."""

    def __init__(self, config: DeploymentConfig, rank: int, generation: int = 0) -> None:
        import actors  # noqa: F401 - registers the `ray` storage backend in this worker

        # The L3 client's ray.get calls run on the step and join threads, never on the
        # event loop; Ray warns about any ray.get in an async actor.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")

        torch.set_num_threads(max(1, int(config.cpus_per_rank)))
        self.config = config
        self.rank = rank
        self.generation = generation
        self.tp_rank = rank % config.tp_size
        self.pp_rank = rank // config.tp_size
        self.device = torch.device(
            "cuda" if config.gpus_per_rank and torch.cuda.is_available() else "cpu"
        )
        self._rendezvous: Rendezvous | None = None
        self._groups: list[GlooConsensus] = []
        self.controller: CacheController | None = None
        self.runtime: RankRuntime | None = None
        self._lock = threading.Lock()
        self._inbox: list[GenerateRequest] = []  # guarded by _lock
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self._publisher = StatsPublisher(config.name, rank)
        self._published_at = 0.0
        self._pause_s = 0.0
        self._in_step = False
        self._step_ended = time.monotonic()
        self._chores: list[tuple[Callable[[], Any], Future[Any]]] = []  # guarded by _lock

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
        cfg, rank = self.config, self.rank

        def group(name: str, group_rank: int, size: int, timeout_s: float) -> GlooConsensus:
            made = GlooConsensus(
                group_rank,
                size,
                host,
                port,
                timeout_s=timeout_s,
                name=f"g{self.generation}-{name}",
                rendezvous=self._rendezvous if rank == 0 else None,
            )
            self._groups.append(made)
            return made

        consensus = group("cache", rank, cfg.world_size, cfg.consensus_timeout_s)
        shard = Shard(
            tp_rank=self.tp_rank, tp_size=cfg.tp_size, pp_rank=self.pp_rank, pp_size=cfg.pp_size
        )
        tp_reduce = None
        if cfg.tp_size > 1:
            tp_group = group(
                f"tp{self.pp_rank}", self.tp_rank, cfg.tp_size, cfg.collective_timeout_s
            )
            tp_reduce = gloo_tp_all_reduce(tp_group.group)
        pipe = None
        if cfg.pp_size > 1:
            pipe_group = group("pipe", rank, cfg.world_size, cfg.collective_timeout_s)
            pipe = StagePipe(pipe_group.group, rank, cfg.tp_size, cfg.pp_size)
        kv = ShardKV(model=cfg.model.model_kv(), shard=shard, page_size=cfg.cache.memory.page_size)
        self.controller = CacheController(
            cfg.cache,
            kv,
            consensus=consensus,
            device=self.device,
            host_budget_bytes=cfg.host_budget_bytes or None,
        )
        model = ReferenceModel(cfg.model, shard, tp_all_reduce=tp_reduce, device=self.device)
        self.runtime = RankRuntime(self.controller, model, pipe=pipe, reuse_prefix=cfg.reuse_prefix)
        self._thread = threading.Thread(target=self._loop, name=f"hicache-rank{rank}", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> RequestResult:
        """Rank 0: run ``request`` to completion; raises :class:`RankFailure` when the
        ranks stopped stepping before it finished."""
        if self.rank != 0:
            raise ValueError("requests go to rank 0")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if self.error is not None:
                raise RankFailure(f"rank {self.rank} stopped: {self.error}")
            if request.rid in self._waiters:
                return RequestResult(rid=request.rid, error="request id already in flight")
            self._waiters[request.rid] = (loop, future)
            self._inbox.append(request)
        self._wake.set()
        result: RequestResult = await future
        return result

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, Any]:
        """This rank's controller and storage statistics, as plain data."""
        import msgspec

        out: dict[str, Any] = {"rank": self.rank, "error": self.error}
        if self.controller is not None:
            out["controller"] = msgspec.to_builtins(self.controller.stats())
            if self.controller.storage is not None:
                out["storage"] = msgspec.to_builtins(self.controller.storage.stats())
        return out

    def health(self) -> dict[str, Any]:
        """``stepping`` (the step thread runs), ``steps``, ``error``, and where the thread
        is: ``in_step`` (in a step, possibly waiting in a collective) or for how long it has
        been outside one (``outside_step_s``: a stalled rank's grows past the timeout)."""
        alive = self._thread is not None and self._thread.is_alive()
        steps = self.controller.stats_.steps if self.controller is not None else 0
        outside = None if self._in_step else time.monotonic() - self._step_ended
        return {
            "rank": self.rank,
            "stepping": alive,
            "steps": steps,
            "error": self.error,
            "in_step": self._in_step,
            "outside_step_s": outside,
        }

    def idle(self) -> bool:
        """Rank 0: no request in flight and, as of the last step, no rank has background
        work (host writes, prefetches, backups) left."""
        rt = self.runtime
        return rt is not None and not (self._inbox or rt.has_work or rt.busy)

    def pause(self, seconds: float) -> None:
        """Fault injection (tests, ``bench faults``): the step thread stalls for
        ``seconds`` before its next step, as a hung rank would."""
        self._pause_s = seconds

    def crash_at(self, phase: str) -> None:
        """Fault injection: the process exits (as a crash would) the next time its step
        reaches ``phase`` ("admit": requests admitted, prefetches running; "prefill";
        "decode")."""
        if phase not in ("admit", "prefill", "decode"):
            raise ValueError(f"unknown phase {phase!r}")
        assert self.runtime is not None

        def crash(reached: str) -> None:
            if reached == phase:
                log.error("rank %d: crashing at %s (fault injection)", self.rank, phase)
                os._exit(1)

        self.runtime.on_phase = crash

    def check_integrity(self) -> None:
        """The cache's invariants, checked between two steps."""
        if self.controller is not None:
            self._between_steps(self.controller.cache.check_integrity)

    def evict_all(self) -> dict[str, int]:
        """Between two steps: evict every unlocked page; the pages still in use (none
        after a drain, unless locks leaked) and the cache's invariants checked."""
        assert self.controller is not None
        cache = self.controller.cache

        def evict() -> dict[str, int]:
            device, host = cache.evict_all()
            cache.check_integrity()
            return {"device_pages_used": device, "host_pages_used": host}

        result: dict[str, int] = self._between_steps(evict)
        return result

    def _between_steps(self, chore: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """Run ``chore`` on the step thread between two steps (it owns the cache)."""
        if self._thread is None or not self._thread.is_alive():
            return chore()  # not stepping: nothing else touches the cache
        done: Future[Any] = Future()
        with self._lock:
            self._chores.append((chore, done))
        self._wake.set()
        return done.result(timeout=timeout_s)

    # ------------------------------------------------------------- stepping

    def _loop(self) -> None:
        rt, cfg = self.runtime, self.config
        assert rt is not None
        try:
            while True:  # until the actor is killed or a step fails
                with self._lock:
                    chores, self._chores = self._chores, []
                for chore, done in chores:
                    try:
                        done.set_result(chore())
                    except Exception as exc:
                        done.set_exception(exc)
                if self._pause_s:
                    pause, self._pause_s = self._pause_s, 0.0
                    time.sleep(pause)
                if self.rank == 0:
                    if not (self._inbox or rt.has_work or self._chores):
                        self._wake.wait(_BUSY_STEP_S if rt.busy else cfg.idle_step_s)
                    self._wake.clear()
                    with self._lock:
                        inbox, self._inbox = self._inbox, []
                    for request in inbox:
                        rt.submit(request)
                self._in_step = True
                results = rt.step()
                self._in_step, self._step_ended = False, time.monotonic()
                for result in results:
                    self._resolve(result)
                now = time.monotonic()
                if now - self._published_at >= _PUBLISH_EVERY_S and self.controller is not None:
                    self._published_at = now
                    self._publisher.publish(self.controller.stats())
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("rank %d stopped stepping: %s\n%s", self.rank, exc, traceback.format_exc())
            with self._lock:
                waiters, self._waiters = self._waiters, {}
            failure = RankFailure(f"rank {self.rank} stopped: {self.error}")
            for loop, future in waiters.values():
                loop.call_soon_threadsafe(_fail, future, failure)

    def _resolve(self, result: RequestResult) -> None:
        with self._lock:
            waiter = self._waiters.pop(result.rid, None)
        if waiter is not None:
            loop, future = waiter
            loop.call_soon_threadsafe(_succeed, future, result)


def _succeed(future: asyncio.Future[Any], result: RequestResult) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future[Any], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
