"""What one backend knows is stored: bytes per key, LRU order, byte budget, metadata cache.

Not thread-safe by itself: :class:`~hicache_ray.storage.paged.PagedBackend` holds its lock
around every call. Budget: a put reserves its bytes first (:meth:`PageIndex.reserve`),
evicting least recently used pages until the reservation fits; the reservation becomes an
entry when the write succeeds (:meth:`PageIndex.commit`) or is given back
(:meth:`PageIndex.release`). Metadata cache: a key seen present is trusted for ``ttl_s``;
absence is never cached for lookups and reads, so pages other writers store show up at
once. It is noted for the next write only (:meth:`PageIndex.note_absent`): a backup asks
whether each of its pages exists (``exists_each``, one lookup), then writes the ones seen
absent without asking about them again (a page another writer stored meanwhile is written
again, which is harmless: the same name holds the same bytes).

Accounting identity (:meth:`PageIndex.check_integrity`): ``used_bytes`` equals the bytes of
the entries plus the reservations outstanding, and the entries fit the capacity.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["PageIndex"]

_MAX_ABSENT = 1 << 16  # absence notes kept (oldest dropped first)


class _Entry:
    __slots__ = ("checked_at", "num_bytes")

    def __init__(self, num_bytes: int, checked_at: float) -> None:
        self.num_bytes = num_bytes
        self.checked_at = checked_at


class PageIndex:
    """Stored keys in LRU order (least recent first), a byte budget and a TTL.

    Args:
        capacity_bytes: most bytes of entries plus reservations; 0 for no limit.
        ttl_s: how long a key seen present is trusted without asking the store.
    """

    def __init__(self, capacity_bytes: int = 0, ttl_s: float = 5.0) -> None:
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._absent: OrderedDict[str, float] = OrderedDict()  # key -> when seen absent
        self.used_bytes = 0  # entries plus outstanding reservations
        self.reserved_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def stored_bytes(self) -> int:
        return self.used_bytes - self.reserved_bytes

    def fresh(self, key: str, now: float) -> bool:
        """``key`` was seen present less than ``ttl_s`` ago."""
        entry = self._entries.get(key)
        return entry is not None and now - entry.checked_at < self.ttl_s

    def note_absent(self, key: str, now: float) -> None:
        """``key`` was seen absent at ``now``: the next write may skip asking (see above)."""
        self._absent[key] = now
        self._absent.move_to_end(key)
        while len(self._absent) > _MAX_ABSENT:
            self._absent.popitem(last=False)

    def take_absent(self, key: str, now: float) -> bool:
        """``key`` was seen absent less than ``ttl_s`` ago (the note is used up)."""
        seen = self._absent.pop(key, None)
        return seen is not None and now - seen < self.ttl_s

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used (if known)."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def remember(self, key: str, num_bytes: int, now: float) -> None:
        """Record ``key`` as present with ``num_bytes`` (seen at ``now``), most recent."""
        self._absent.pop(key, None)
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _Entry(num_bytes, now)
            self.used_bytes += num_bytes
        else:
            self.used_bytes += num_bytes - entry.num_bytes
            entry.num_bytes, entry.checked_at = num_bytes, now
            self._entries.move_to_end(key)

    def forget(self, key: str) -> None:
        """Drop ``key`` (it is absent, corrupt or deleted)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.num_bytes

    def reserve(self, num_bytes: int) -> list[str] | None:
        """Reserve ``num_bytes`` for a write; returns the keys evicted to make room (the
        caller deletes them), or None when it cannot fit even with nothing else stored."""
        if self.capacity_bytes:
            if num_bytes > self.capacity_bytes:
                return None
            victims = self.evict_to(self.capacity_bytes - num_bytes)
            if self.used_bytes + num_bytes > self.capacity_bytes:  # reservations in flight
                return None
        else:
            victims = []
        self.used_bytes += num_bytes
        self.reserved_bytes += num_bytes
        return victims

    def release(self, num_bytes: int) -> None:
        """Give back a reservation whose write failed."""
        self.used_bytes -= num_bytes
        self.reserved_bytes -= num_bytes

    def commit(self, key: str, reserved_bytes: int, num_bytes: int, now: float) -> None:
        """The write of ``key`` (``num_bytes``, at most ``reserved_bytes``) succeeded: its
        reservation becomes its entry."""
        self.release(reserved_bytes)
        self.remember(key, num_bytes, now)

    def evict_to(self, limit_bytes: int) -> list[str]:
        """Drop least recently used entries until ``used_bytes <= limit_bytes``; returns them."""
        victims = []
        while self.used_bytes > limit_bytes and self._entries:
            key, entry = self._entries.popitem(last=False)
            self.used_bytes -= entry.num_bytes
            victims.append(key)
        return victims

    def check_integrity(self) -> None:
        """``used_bytes`` is the entries plus the reservations; the entries fit the budget."""
        total = sum(e.num_bytes for e in self._entries.values())
        assert self.reserved_bytes >= 0, f"negative reservations {self.reserved_bytes}"
        assert self.used_bytes == total + self.reserved_bytes, (
            f"used {self.used_bytes} != entries {total} + reserved {self.reserved_bytes}"
        )
        assert not self.capacity_bytes or total <= self.capacity_bytes, "over capacity"
