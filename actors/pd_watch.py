"""What the two sides of a prefill/decode pair hold, kept from their cache events.

:class:`JournalWatch` is a thread in the caller's process (the pair's driver) that reads
each side's journal (:meth:`~actors.deployment.Deployment.cache_events`) into one
:class:`~hicache_ray.serving.cache_index.CacheIndex`: the decode side's L1 and L2 pages
(what a request would find cached there, for the split decision) and the L3 pages either
side backed up (what a handoff waits for). A journal that re-formed or moved past what it
keeps is read again from its snapshot. While a handoff waits it reads every ``poll_s``,
otherwise every ``IDLE_POLL_S``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from hicache_ray.cache.events import EventBatch
from hicache_ray.serving.cache_index import CacheIndex, Hits

__all__ = ["IDLE_POLL_S", "JournalWatch"]

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often the journals are read while no handoff waits


class Journal(Protocol):
    """A deployment's cache-event journal (:class:`~actors.deployment.Deployment`)."""

    def cache_events(self, epoch: str, seq: int) -> list[EventBatch] | None: ...

    def cache_snapshot(self) -> EventBatch: ...


class JournalWatch(threading.Thread):
    """The pair's view of both sides' caches (see the module docstring)."""

    def __init__(self, sources: Mapping[str, Journal], poll_s: float) -> None:
        super().__init__(name="hicache-pd-watch", daemon=True)
        self._sources = dict(sources)
        self._poll_s = poll_s
        self._index = CacheIndex()
        self._lock = threading.Lock()  # guards _index and _waiting
        self._waiting = 0  # handoffs waiting (read more often while any does)
        self._wake = threading.Event()
        self._halt = threading.Event()
        self.rounds = 0  # journal reads completed (every source once)
        self.first_round = threading.Event()  # set once every source was read once

    def run(self) -> None:
        while not self._halt.is_set():
            for name, source in self._sources.items():
                try:
                    self._read(name, source)
                except Exception as exc:  # re-forming, shut down or slow: next round
                    log.debug("cache events of %s not read: %s", name, exc)
            self.rounds += 1
            self.first_round.set()
            self._wake.wait(self._poll_s if self._waiting else IDLE_POLL_S)
            self._wake.clear()

    def _read(self, name: str, source: Journal) -> None:
        with self._lock:
            epoch, seq = self._index.position(name)
        batches = source.cache_events(epoch, seq)
        if batches is None:
            snapshot = source.cache_snapshot()
            with self._lock:
                self._index.reset(name, snapshot)
            return
        with self._lock:
            for batch in batches:
                if not self._index.apply(name, batch):
                    self._index.remove(name)  # a gap: the next round takes a snapshot
                    return

    def hits(self, name: str, hashes: Sequence[str]) -> Hits:
        """What side ``name`` holds of the prompt with page hashes ``hashes``."""
        with self._lock:
            return self._index.hits(name, hashes)

    def stored(self, hashes: Sequence[str]) -> int:
        """Leading pages of ``hashes`` known to be in L3."""
        with self._lock:
            return self._index.stored(hashes)

    async def wait_stored(self, hashes: Sequence[str], deadline: float, skip: int = 0) -> int:
        """Wait until L3 holds every page of ``hashes`` past the first ``skip`` (taken as
        held) or ``deadline`` (monotonic) passes; the leading pages held then."""
        with self._lock:
            self._waiting += 1
        self._wake.set()
        try:
            while True:
                stored = skip + self.stored(hashes[skip:])
                if stored >= len(hashes) or time.monotonic() >= deadline:
                    return stored
                await asyncio.sleep(self._poll_s)
        finally:
            with self._lock:
                self._waiting -= 1

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()
