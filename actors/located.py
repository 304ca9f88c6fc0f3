"""Where a prefetch query found its pages, kept for the reads that follow it.

A leading lookup of the ``ray`` store asks each shard ``find``: sizes and object
references at once. :class:`Located` keeps those references for ``ttl_s`` (the reads come
within milliseconds), so a read of the same keys asks no shard: one store round trip
fewer on an L3 hit's critical path. A key is taken by the first read that asks for it, and
forgotten when removed. A kept reference keeps its object alive even if its shard drops
it; what it reads is the page that was stored under the key (pages are named by content,
and every read is verified), so a stale one is still right.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Located"]

TTL_S = 2.0  # how long a lookup's references serve reads
MAX_KEYS = 1 << 14  # keys kept at most (the oldest go first)


class Located:
    """Key -> (object reference, item) from recent leading lookups (thread-safe)."""

    def __init__(
        self,
        ttl_s: float = TTL_S,
        max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s, self._max, self._clock = ttl_s, max_keys, clock
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[Any, int, float]] = {}  # guarded; in expiry order

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def remember(
        self,
        keys: Sequence[str],
        refs: Sequence[Any],
        places: Sequence[tuple[int, int] | None],
        sizes: Sequence[int | None],
    ) -> None:
        """Keep where a shard's ``find`` answer put ``keys`` (absent ones are dropped)."""
        now = self._clock()
        with self._lock:
            self._sweep(now)
            for key, place, size in zip(keys, places, sizes, strict=True):
                self._kept.pop(key, None)  # re-inserted last: the order stays by expiry
                if place is not None and size is not None:
                    self._kept[key] = (refs[place[0]], place[1], now + self._ttl_s)
            while len(self._kept) > self._max:
                del self._kept[next(iter(self._kept))]

    def take(self, keys: Sequence[str]) -> tuple[list[int], tuple[list[Any], list[Any]]]:
        """The indices of ``keys`` still kept, and ``locate``'s answer for them (their
        references, and each one's (reference index, item)); they are kept no longer."""
        now = self._clock()
        known: list[int] = []
        refs: list[Any] = []
        places: list[Any] = []
        with self._lock:
            self._sweep(now)
            for i, key in enumerate(keys):
                found = self._kept.pop(key, None)
                if found is not None:
                    known.append(i)
                    places.append((len(refs), found[1]))
                    refs.append(found[0])
        return known, (refs, places)

    def forget(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._kept.pop(key, None)

    def _sweep(self, now: float) -> None:
        """Drop the expired entries (the oldest first). Holds ``_lock``."""
        stale = []
        for key, (_, _, expires) in self._kept.items():
            if expires > now:
                break
            stale.append(key)
        for key in stale:
            del self._kept[key]
