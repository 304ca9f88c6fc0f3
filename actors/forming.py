"""The ranks of one deployment as a set that forms, fails and re-forms together: the
forming half of :class:`~actors.deployment.Deployment` (states and recovery are described
in :mod:`actors.lifecycle`), and the cache journal of each generation, whose reader is
the first to hear when rank 0 is gone (the set then re-forms at once, not at the next
call)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from actors.lifecycle import (
    DeploymentError,
    DeploymentState,
    Reform,
    ReformFailed,
    describe_failure,
)
from actors.rank_group import find_suspects, kill_ranks, start_ranks, stop_ranks
from hicache_ray.cache.events import EventBatch, check_position, check_wait
from hicache_ray.engine.spec import DeploymentConfig
from placement.groups import StageGroups

__all__ = ["SLICE_S", "RankSet"]

log = logging.getLogger("actors.deployment")

SLICE_S = 0.5  # a wait checks for shutdown this often


class RankSet:
    """Generation ``generation`` of a deployment's ranks in its placement ``groups``;
    ``_lock`` serializes forming, re-forming and shutdown."""

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
        # the ranks' calls that wait (re-forming, a retry's wait for it) run here
        self._executor = ThreadPoolExecutor(32, thread_name_prefix=f"hicache-{config.name}")

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

    def _serving_now(self) -> tuple[int, Any] | None:
        """:meth:`_serving` when it needs no wait (serving, nobody forming): the request
        path then takes no thread hop; None otherwise."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed.is_set() or self.state is not DeploymentState.SERVING:
                return None
            return self.generation, self.ranks[0]
        finally:
            self._lock.release()

    def cache_events(self, epoch: str, seq: int, wait_s: float = 0.0) -> list[EventBatch] | None:
        """The cache events of the serving generation after batch ``seq`` of journal
        ``epoch`` (:mod:`hicache_ray.cache.events`), waiting up to ``wait_s`` for one when
        none is new; None: take :meth:`cache_snapshot` (the deployment re-formed since, or
        the batches are no longer kept, or it has no ranks).

        A rank 0 found dead here starts the re-forming in the background (:meth:`_heal`)
        before the error is raised: a replica's publisher asks this all the time, so an
        idle deployment heals as soon as its rank 0 goes, and the next call finds it
        serving again instead of re-forming it.

        Raises:
            TypeError, ValueError: ``epoch`` not a str, ``seq`` not an int >= 0, ``wait_s``
                not a number in [0, 10].
            ActorDiedError: rank 0 died (the re-forming has started).
        """
        epoch, seq = check_position(epoch, seq)
        wait_s = check_wait(wait_s)
        with self._lock:
            generation, ranks = self.generation, list(self.ranks)
        if not ranks:
            return None
        ref = ranks[0].cache_events.remote(epoch, seq, wait_s)
        try:
            return ray.get(ref, timeout=30 + wait_s)  # type: ignore[no-any-return]
        except ActorDiedError as exc:
            if not self._closed.is_set():
                self._executor.submit(self._heal, generation, exc)
            raise

    def cache_snapshot(self) -> EventBatch:
        """What the serving generation's tree holds now, as one batch of cache events.

        Raises:
            DeploymentError: the deployment has no ranks (broken or shut down).
        """
        ranks = self._ranks()
        if not ranks:
            raise DeploymentError(f"deployment is {self.state.value}: no cache to describe")
        snapshot: EventBatch = ray.get(ranks[0].cache_snapshot.remote(), timeout=60)
        return snapshot

    def _heal(self, seen_generation: int, cause: BaseException) -> None:
        """Re-form after ``cause`` took a rank of ``seen_generation`` (nothing when a call
        re-formed after it already); a failure leaves the deployment broken, as a call's
        re-forming would, and the next call tries again."""
        try:
            self._reform(seen_generation, cause)
        except Exception as exc:  # shut down meanwhile, or broken: no caller to tell
            log.warning("deployment %s: healing failed: %s", self.config.name, exc)

    def _wait_all(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """Results of ``refs``; fails as soon as one fails, on shutdown, or at the deadline."""
        deadline = time.monotonic() + timeout_s
        left = list(refs)
        while left:
            self._check_open()
            budget = deadline - time.monotonic()
            if budget <= 0:
                raise TimeoutError(f"{len(left)} rank(s) did not answer within {timeout_s:g}s")
            ready, left = ray.wait(left, num_returns=1, timeout=min(SLICE_S, budget))
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
