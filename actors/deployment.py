"""``Deployment``: the driver side of one TP x PP deployment.

:meth:`Deployment.launch` places the ranks (one bundle each, see :mod:`placement`), starts
one :class:`~actors.rank.RankActor` per rank in its bundle, has rank 0 bind the rendezvous
store and every rank join the groups. Requests go to rank 0 (:meth:`Deployment.generate`,
:meth:`Deployment.submit`, :meth:`Deployment.generate_async`); every rank runs them in
lock step and rank 0 answers with each request's result and cache statistics.

Recovery: when a rank dies, stalls past the consensus timeout or raises, the requests in
flight fail with :class:`~actors.rank.RankFailure` (or Ray's actor error). The deployment
then re-forms: it kills every rank, starts new ones in the same placement groups (Ray
re-places a group's bundles when a node is lost), and retries those requests, up to
``max_retries`` times. L1/L2 of the old ranks are gone; L3 is not, so the retried requests
find their prefixes there when the storage backend outlives the ranks (``ray``, ``file``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.rank import RankActor, RankFailure
from actors.spec import DeploymentConfig
from hicache_ray.errors import HiCacheError
from hicache_ray.runtime import GenerateRequest, RequestResult
from placement.groups import StageGroups, acquire_groups, release_groups
from placement.plan import plan_stages

__all__ = ["Deployment", "DeploymentError"]

log = logging.getLogger(__name__)

_Rank = ray.remote(RankActor)
_POLL_S = 0.02  # how often wait_idle asks rank 0


class DeploymentError(HiCacheError, RuntimeError):
    """The deployment could not be formed, or a request failed after every retry."""


def _describe(exc: BaseException | None) -> str:
    """The failure in one line: the rank's own error rather than Ray's wrapper."""
    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    if isinstance(exc, RayActorError):
        return f"a rank actor died: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return str(exc)[:500]


def _is_rank_failure(exc: BaseException) -> bool:
    if isinstance(exc, RayActorError):
        return True
    return isinstance(exc, RayTaskError) and isinstance(exc.cause, RankFailure)


class Deployment:
    """A running deployment; make one with :meth:`launch`, end it with :meth:`shutdown`."""

    def __init__(self, config: DeploymentConfig, groups: StageGroups) -> None:
        self.config = config
        self.groups = groups
        self.generation = 0
        self.reforms: list[dict[str, Any]] = []  # when and why each re-forming happened
        self.ranks: list[Any] = []
        self._lock = threading.Lock()  # serializes re-forming
        self._executor = ThreadPoolExecutor(32, thread_name_prefix=f"hicache-{config.name}")

    @classmethod
    def launch(cls, config: DeploymentConfig) -> Deployment:
        """Place and start the ranks; returns once every rank is stepping.

        Raises:
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
        groups = acquire_groups(stages, timeout_s=config.placement_timeout_s, name=config.name)
        deployment = cls(config, groups)
        try:
            deployment._form()
        except BaseException:
            release_groups(groups)
            raise
        return deployment

    # ------------------------------------------------------------- requests

    def generate(self, requests: Sequence[GenerateRequest]) -> list[RequestResult]:
        """Run ``requests`` (at once) and return their results in the same order.

        Raises:
            DeploymentError: a request still failed after ``max_retries`` re-formings.
        """
        results: dict[int, RequestResult] = {}
        pending = list(range(len(requests)))
        for attempt in range(self.config.max_retries + 1):
            generation, rank0 = self.generation, self.ranks[0]
            refs = [rank0.generate.remote(requests[i]) for i in pending]
            failed, cause = [], None
            for i, ref in zip(pending, refs, strict=True):
                try:
                    results[i] = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    if not _is_rank_failure(exc):
                        raise
                    failed.append(i)
                    cause = exc
            if not failed:
                break
            if attempt == self.config.max_retries:
                raise DeploymentError(
                    f"{len(failed)} request(s) failed after {attempt} retries: {_describe(cause)}"
                ) from cause
            self._reform(generation, cause)
            pending = failed
        return [results[i] for i in range(len(requests))]

    def submit(self, request: GenerateRequest) -> Future[RequestResult]:
        """Run ``request`` in the background; the future holds its result."""
        return self._executor.submit(lambda: self.generate([request])[0])

    async def generate_async(self, request: GenerateRequest) -> RequestResult:
        """:meth:`generate` of one request for asyncio callers (a Serve replica)."""
        for attempt in range(self.config.max_retries + 1):
            generation = self.generation
            try:
                result: RequestResult = await self.ranks[0].generate.remote(request)
                return result
            except (RayActorError, RayTaskError) as exc:
                if not _is_rank_failure(exc) or attempt == self.config.max_retries:
                    raise
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._reform, generation, exc
                )
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, Any]:
        """Every rank's statistics plus the deployment's shape and re-formings."""
        ranks = ray.get([r.stats.remote() for r in self.ranks])
        return {
            "name": self.config.name,
            "tp_size": self.config.tp_size,
            "pp_size": self.config.pp_size,
            "generation": self.generation,
            "reforms": list(self.reforms),
            "ranks": ranks,
        }

    def health(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Per rank: whether it answers and is stepping, its step count and last error."""
        out = []
        for rank, actor in enumerate(self.ranks):
            try:
                out.append(ray.get(actor.health.remote(), timeout=timeout_s))
            except Exception as exc:
                out.append({"rank": rank, "stepping": False, "steps": 0, "error": repr(exc)})
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Block until no request is in flight and every rank's background work (host
        writes, prefetches, L3 backups) is done and acknowledged.

        Raises:
            TimeoutError: still busy after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while not ray.get(self.ranks[0].idle.remote()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"deployment {self.config.name!r} still busy after {timeout_s}s")
            time.sleep(_POLL_S)

    def shutdown(self) -> None:
        """Stop every rank and release the placement groups this deployment made."""
        self._kill_ranks()
        release_groups(self.groups)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------- forming

    def _form(self) -> None:
        cfg = self.config
        self.ranks = []
        for rank in range(cfg.world_size):
            pp, tp = divmod(rank, cfg.tp_size)
            bundle = self.groups.bundle_offsets[pp] + self.groups.rank_bundles[pp][tp]
            strategy = PlacementGroupSchedulingStrategy(
                self.groups.groups[pp], placement_group_bundle_index=bundle
            )
            self.ranks.append(
                _Rank.options(
                    num_cpus=cfg.cpus_per_rank,
                    num_gpus=cfg.gpus_per_rank,
                    scheduling_strategy=strategy,
                    name=f"hicache-{cfg.name}-g{self.generation}-rank{rank}",
                    namespace="hicache",
                ).remote(cfg, rank, self.generation)
            )
        timeout = cfg.placement_timeout_s + cfg.consensus_timeout_s
        try:
            host, port = ray.get(self.ranks[0].start_rendezvous.remote(), timeout=timeout)
            ray.get([r.join.remote(host, port) for r in self.ranks], timeout=timeout)
        except Exception as exc:
            self._kill_ranks()
            raise DeploymentError(
                f"deployment {cfg.name!r} (TP={cfg.tp_size}, PP={cfg.pp_size}) did not form: {exc}"
            ) from exc
        log.info("deployment %s formed (generation %d)", cfg.name, self.generation)

    def _reform(self, seen_generation: int, cause: BaseException | None) -> None:
        """Replace every rank (once per failure, however many callers saw it)."""
        with self._lock:
            if self.generation != seen_generation:
                return  # another caller already re-formed after this failure
            started = time.monotonic()
            why = f"{_describe(cause)}; suspects: {', '.join(self._suspects()) or 'none found'}"
            log.warning("deployment %s: re-forming after %s", self.config.name, why)
            self._kill_ranks()
            self.generation += 1
            self._form()
            self.reforms.append(
                {
                    "generation": self.generation,
                    "cause": why,
                    "seconds": time.monotonic() - started,
                }
            )

    def _suspects(self, timeout_s: float = 2.0) -> list[str]:
        """The ranks that caused a failure, as far as asking them tells: those that do not
        answer (dead or hung), and those stuck outside a step while the others waited in
        its collective (a stalled rank; the others report the timeout, not who stalled)."""
        refs = [actor.health.remote() for actor in self.ranks]
        found = []
        for rank, ref in enumerate(refs):
            try:
                health = ray.get(ref, timeout=timeout_s)
            except Exception:
                found.append(f"rank {rank} does not answer (dead or hung)")
                continue
            outside = health.get("outside_step_s")
            if (
                health["error"] is None
                and outside
                and outside > self.config.consensus_timeout_s / 2
            ):
                found.append(f"rank {rank} stalled outside the step for {outside:.1f} s")
        return found

    def _kill_ranks(self) -> None:
        for actor in self.ranks:
            ray.kill(actor, no_restart=True)
        self.ranks = []
