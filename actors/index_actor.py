"""The cache index of an application of engine replicas, as an actor, and the thread that
feeds it from one replica.

:class:`IndexActor` (one per application, named after it) owns the application's
:class:`~hicache_ray.serving.index_feed.IndexFeed`: replicas write their cache events
there, routers read it (:mod:`actors.routing`). :class:`Publisher` runs in each engine
replica and sends its journal's new batches every ``PUBLISH_EVERY_S``: a
:class:`~actors.deployment.Deployment`'s, or a vLLM engine's
(:class:`~hicache_ray.integrations.vllm.events.VllmJournal`, :mod:`actors.vllm_serve`).

Routers make the index (:func:`index_actor`); publishers only find it (:func:`find_index`)
and wait for it. A Ray actor lives as long as the process that made it, so the index lives
in a router's process (the ingress), not in an engine replica's: a replica that dies, is
replaced or scaled down takes no index with it, and the routers keep what the others
published.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import ray

from actors.event_poll import Ticker
from hicache_ray.cache.events import EventBatch, check_wait
from hicache_ray.serving.cache_index import Hits, down_snapshot
from hicache_ray.serving.index_feed import FeedUpdate, IndexFeed

__all__ = ["EventSource", "IndexActor", "Publisher", "find_index", "index_actor"]

log = logging.getLogger(__name__)

PUBLISH_EVERY_S = 0.02  # a replica's pause after sending new cache events to the index
POLL_S = 0.5  # how long a replica's (or a router's) ask waits for the next change
FIND_EVERY_S = 1.0  # how often a replica looks for an index no router has made yet
HEARTBEAT_S = 1.0  # how often a replica asks its position (it is alive; still placed?)
SILENT_S = 30.0  # a replica that has not asked its position this long is gone from the index
_NAMESPACE = "hicache"


class IndexActor:
    """The application's index (an actor named after it): replicas write, routers read.
    Its size and each replica's lag are gauges: ``hicache_route_index_pages`` (tag
    ``app``) and ``hicache_route_index_lag_seconds`` (tags ``app``, ``replica``)."""

    def __init__(self, app: str = "") -> None:
        from ray.util.metrics import Gauge

        self.feed = IndexFeed()
        self.index = self.feed.index
        self._changed = Ticker()  # routers' long polls wait on it
        self._app = app
        self._seen: dict[str, float] = {}  # replica -> when it last asked its position
        self._pages = Gauge(
            "hicache_route_index_pages",
            description="page entries the cache router's index holds (every replica, tier)",
            tag_keys=("app",),
        )
        self._lag = Gauge(
            "hicache_route_index_lag_seconds",
            description="age of the newest cache-event batch applied, per replica",
            tag_keys=("app", "replica"),
        )

    def _observe(self, replica: str) -> None:
        self._pages.set(self.index.size, tags={"app": self._app})
        lag = self.index.lag_s(replica, time.time())
        self._lag.set(lag, tags={"app": self._app, "replica": replica})

    def position(self, replica: str) -> tuple[str, int]:
        """Where ``replica``'s journal stands here; the publisher asks every
        ``HEARTBEAT_S``, so this is its heartbeat: a replica silent for ``SILENT_S``
        (killed without a goodbye) is forgotten, its pages with it."""
        now = time.monotonic()
        self._seen[replica] = now
        for other, seen in list(self._seen.items()):
            if now - seen > SILENT_S:
                del self._seen[other]
                self.feed.remove(other)
                self._changed.tick()
        return self.index.position(replica)

    def apply(self, replica: str, batches: list[EventBatch]) -> bool:
        """Apply ``replica``'s batches in order; False at the first that does not follow."""
        applied = self.feed.apply(replica, batches)
        self._observe(replica)
        self._changed.tick()
        return applied

    def reset(self, replica: str, snapshot: EventBatch) -> None:
        self.feed.reset(replica, snapshot)
        self._observe(replica)
        self._changed.tick()

    def remove(self, replica: str) -> None:
        self._seen.pop(replica, None)
        self.feed.remove(replica)
        self._changed.tick()

    async def changes(self, epoch: str, seq: int, wait_s: float = 0.0) -> FeedUpdate:
        """What a router's copy of the index at ``(epoch, seq)`` needs
        (:meth:`~hicache_ray.serving.index_feed.IndexFeed.changes`); a copy that has every
        change waits up to ``wait_s`` for the next (a long poll)."""
        if check_wait(wait_s) > 0 and (epoch, seq) == (self.feed.epoch, self.feed.seq):
            await self._changed.wait(wait_s)
        return self.feed.changes(epoch, seq)

    def hits(self, replicas: list[str], hashes: list[str]) -> dict[str, Hits]:
        return {r: self.index.hits(r, hashes) for r in replicas}

    def facts(
        self, replicas: list[str], hashes: list[str]
    ) -> tuple[dict[str, Hits], dict[str, int]]:
        """:meth:`~hicache_ray.serving.cache_index.CacheIndex.facts` (a router whose copy
        of the index is not fresh asks this)."""
        return self.index.facts(replicas, hashes)

    def size(self) -> int:
        return self.index.size

    def replicas(self) -> list[str]:
        return self.index.replicas


def index_actor(app: str) -> Any:
    """The index of application ``app``, made if none runs (by a router or a benchmark's
    reader: it lives as long as the process that made it, and the next to ask makes it
    again)."""
    actor = ray.remote(num_cpus=0)(IndexActor)
    return actor.options(name=_name(app), namespace=_NAMESPACE, get_if_exists=True).remote(app)


def find_index(app: str) -> Any | None:
    """The index of application ``app`` if one runs, else None (never made here)."""
    try:
        return ray.get_actor(_name(app), namespace=_NAMESPACE)
    except ValueError:
        return None


def _name(app: str) -> str:
    return f"hicache-index-{app}"


class EventSource(Protocol):
    """A journal of one replica's cache: a :class:`Deployment`'s (it waits up to
    ``wait_s`` for a batch when none is new), or a vLLM engine's (:class:`~hicache_ray.
    integrations.vllm.events.VllmJournal`, in the replica's process: it answers at once)."""

    def cache_events(
        self, epoch: str, seq: int, wait_s: float = 0.0
    ) -> list[EventBatch] | None: ...

    def cache_snapshot(self) -> EventBatch: ...


class Publisher(threading.Thread):
    """Sends one replica's cache events to the index once a router has made it (nobody
    reads it before; the first batch then is a snapshot). Each round asks the replica's
    journal for its batches after the last one sent, waiting up to ``POLL_S`` for one
    (a long poll: an idle replica makes no call), sends them, then pauses
    ``PUBLISH_EVERY_S`` so that a busy replica's events go in batches. Its position in
    the index is asked every ``HEARTBEAT_S`` (the index's sign that it lives), and again
    after any failure. When the journal's rank 0 is found dead, the index marks the
    replica down at once (its L1 and L2 died with the ranks; routers rank it last; the
    deployment re-forms on its own, :meth:`~actors.forming.RankSet.cache_events`), and
    the re-formed ranks' snapshot brings it back. Until an index exists it looks for one
    every ``FIND_EVERY_S``: behind Ray's routers (``prefix``, ``pow2``) no router makes
    one, and a lookup is a call to Ray's control store."""

    def __init__(self, source: EventSource, app: str, replica: str) -> None:
        super().__init__(name="hicache-events", daemon=True)
        self._deployment, self._app, self._replica = source, app, replica
        self._halt = threading.Event()
        self._index: Any = None
        self._position: tuple[str, int] | None = None  # the index's, as last known
        self._asked = float("-inf")  # when the position was last asked
        self._lost = False  # the index was told the replica's caches died (until it answers)

    def run(self) -> None:
        wait = PUBLISH_EVERY_S
        while not self._halt.wait(wait):
            try:
                wait = self._publish()
            except ray.exceptions.ActorDiedError as exc:
                if "IndexActor" in str(exc):  # its maker went: found again once remade
                    self._index = None
                else:  # the replica's rank 0: the caches it reported died with it
                    self._forget()
                self._position = None
                log.debug("cache events of %s not published: %s", self._replica, exc)
            except Exception as exc:  # the ranks are re-forming, or slow: next round
                self._position = None
                log.debug("cache events of %s not published: %s", self._replica, exc)

    def _publish(self) -> float:
        """Send what is new; the pause before the next round."""
        if self._index is None:
            self._index = find_index(self._app)
            if self._index is None:
                return FIND_EVERY_S  # no router has made it yet
        if self._position is None or time.monotonic() - self._asked >= HEARTBEAT_S:
            self._asked = time.monotonic()
            ask = self._index.position.remote(self._replica)
            epoch, seq = ray.get(ask, timeout=10)
            self._position = (epoch, seq)
        batches = self._deployment.cache_events(*self._position, wait_s=POLL_S)
        if batches is None:
            snapshot = self._deployment.cache_snapshot()
            ray.get(self._index.reset.remote(self._replica, snapshot), timeout=10)
            self._position = (snapshot.epoch, snapshot.seq)
        elif batches and ray.get(self._index.apply.remote(self._replica, batches), timeout=10):
            self._position = (batches[-1].epoch, batches[-1].seq)
        elif batches:  # a gap: forgotten, so the next round's position asks for a snapshot
            ray.get(self._index.remove.remote(self._replica), timeout=10)
            self._position = None
        self._lost = False
        return PUBLISH_EVERY_S

    def _forget(self) -> None:
        """The replica's ranks died: the index marks it down now, its pages gone, once,
        rather than when the re-formed ranks' first snapshot replaces them (seconds on:
        meanwhile routers would send its turns to caches that died, to wait behind the
        re-forming)."""
        if self._lost or self._index is None:
            return
        try:
            ray.get(self._index.reset.remote(self._replica, down_snapshot(time.time())), timeout=10)
            self._lost = True
        except Exception as exc:  # the index is down too: it is remade empty
            log.debug("index not told that %s lost its caches: %s", self._replica, exc)

    def stop(self) -> None:
        self._halt.set()
        if self._index is not None:
            self._index.remove.remote(self._replica)
