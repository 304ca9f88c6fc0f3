"""The write side of :class:`~hicache_ray.storage.paged.PagedBackend`: which pages of a put
are new, room for them under the byte budget, and the index after the store's answers.

A mixin over the backend's state (its lock guards the index and the counters; object I/O
runs outside it), kept apart so each file reads as one concern.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from hicache_ray.storage.index import PageIndex
from hicache_ray.storage.objects import ObjectStore

__all__ = ["PageWrites"]

log = logging.getLogger("hicache_ray.storage.paged")


class PageWrites:
    """Write bookkeeping of a paged backend (state set by its ``__init__``)."""

    name: str
    objects: ObjectStore
    capacity_bytes: int
    _clock: Callable[[], float]
    _lock: threading.Lock
    _index: PageIndex
    _counts: dict[str, int]

    def _present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (cached answers within the TTL, the rest asked in
        one call); shorter than ``keys`` when a lookup failed (the batch ends there)."""
        now = self._clock()
        found: list[bool] = [False] * len(keys)
        with self._lock:
            # Absent within the TTL (the caller just asked ``exists``): not asked again.
            absent = {i for i, key in enumerate(keys) if self._index.take_absent(key, now)}
            ask = [
                i
                for i, key in enumerate(keys)
                if i not in absent and not self._index.fresh(key, now)
            ]
        asked = set(ask)
        for i in range(len(keys)):
            found[i] = i not in asked and i not in absent
        if not ask:
            return found
        try:
            sizes = self.objects.size_many([keys[i] for i in ask], leading=False)
        except Exception as exc:
            sizes = [exc]
        with self._lock:
            for i, size in zip(ask, sizes, strict=False):
                if isinstance(size, Exception):
                    log.warning("storage %s: looking up %s failed: %s", self.name, keys[i], size)
                    self._counts["put_failures"] += 1
                    return found[:i]
                if size is None:
                    self._index.forget(keys[i])
                else:
                    self._index.remember(keys[i], size, now)
                    found[i] = True
        if len(sizes) < len(ask):  # the store stopped early without saying why
            return found[: ask[len(sizes)]]
        return found

    def _reserve(self, sizes: list[int]) -> int:
        """Reserve room for each new page in key order; returns how many got room (a page
        that cannot fit ends the batch). Deletes the pages evicted for them."""
        reserved = 0
        for size in sizes:
            with self._lock:
                victims = self._index.reserve(size)
                if victims is None:
                    self._counts["put_failures"] += 1
                else:
                    self._counts["evicted_pages"] += len(victims)
            if victims is None:
                log.warning(
                    "storage %s: page %d of a %d-page put (%d bytes) does not fit capacity_bytes"
                    "=%d next to the %d bytes of the pages before it (a put never evicts its own"
                    " pages); it and the %d after it are not stored",
                    *(self.name, reserved + 1, len(sizes), size, self.capacity_bytes),
                    *(sum(sizes[:reserved]), len(sizes) - reserved - 1),
                )
                break
            self._remove(victims)
            reserved += 1
        return reserved

    def _settle_writes(
        self,
        keys: Sequence[str],
        new: list[int],
        sizes: list[int],
        payloads: list[memoryview],
        reserved: int,
        errors: list[Exception | None],
    ) -> int:
        """Turn reservations into entries (or give them back); the leading pages stored."""
        stored = new[reserved] if reserved < len(new) else len(keys)
        now = self._clock()
        with self._lock:
            for j in range(reserved):
                error = errors[j] if j < len(errors) else OSError("not written")
                if error is None:
                    self._index.commit(keys[new[j]], sizes[j], sizes[j], now)
                    self._counts["put_pages"] += 1
                    self._counts["put_bytes"] += payloads[j].nbytes
                    continue
                self._index.release(sizes[j])
                if j < len(errors):
                    self._counts["put_failures"] += 1
                    log.warning("storage %s: writing %s failed: %s", self.name, keys[new[j]], error)
                stored = min(stored, new[j])
        return stored

    def _remove(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            self.objects.remove_many(keys)
        except Exception as exc:
            log.warning("storage %s: deleting %d pages failed: %s", self.name, len(keys), exc)
