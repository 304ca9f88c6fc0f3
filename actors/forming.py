"""The ranks of one deployment as a set that forms, fails and re-forms together: the
forming half of :class:`~actors.deployment.Deployment` (states and recovery are described
in :mod:`actors.lifecycle`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from actors.lifecycle import (
    DeploymentError,
    DeploymentState,
    Reform,
    ReformFailed,
    describe_failure,
)
from actors.rank_group import find_suspects, kill_ranks, start_ranks, stop_ranks
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
