"""Object stores: the dumb byte layer under a paged backend.

An object store keeps framed page objects (see :mod:`page_format`) by key and knows
nothing of namespaces, checksums or budgets; :class:`~hicache_ray.storage.paged.PagedBackend`
adds those. Splitting the two lets one fault injector (:mod:`faults`) sit between them and
corrupt, truncate, fail or delay real stored bytes for every backend alike.

Methods are per key and thread-safe; a write is atomic (a reader sees the whole object or
none of it).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from hicache_ray.storage.page_format import (
    PREFIX_BYTES,
    CorruptPage,
    copy_hashed,
    header_length,
)

__all__ = ["MemoryObjects", "ObjectStore", "ReadOutcome", "split_object"]

# One object's read: header and payload checksum (None: not hashed), an error, or absent.
ReadOutcome = tuple[bytes, str | None] | Exception | None


class ObjectStore(ABC):
    """A keyed store of framed page objects.

    ``parallel_reads``: whether a batch reads several objects at once (on reader threads);
    false where reads are memory copies that one thread already saturates.
    The ``*_many`` methods are what :class:`~hicache_ray.storage.batched.BatchedBackend`
    calls: a remote store answers a whole batch in one round trip; the defaults loop over
    the per-key methods.
    """

    parallel_reads = True

    @abstractmethod
    def write(self, key: str, header: bytes, payload: memoryview) -> None:
        """Store ``header + payload`` under ``key`` atomically; raises ``OSError`` on failure."""

    @abstractmethod
    def read(self, key: str, out: memoryview) -> tuple[bytes, str | None] | None:
        """Read the object of ``key``: its payload into ``out``.

        Returns the header bytes and the checksum of the payload as read (hashed on the
        way in, see :mod:`page_format`) or None for "not hashed: hash ``out``" (the caller
        then hashes it, possibly while the next read runs), or None when the key is
        absent. Raises
        :class:`CorruptPage` when the frame is malformed or the payload is not exactly
        ``len(out)`` bytes; ``OSError`` on I/O errors.
        """

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Stored bytes of ``key``, or None when absent."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """Delete ``key``; absent keys are ignored."""

    @abstractmethod
    def scan(self) -> Iterator[tuple[str, int, float]]:
        """``(key, bytes, modification time)`` of every stored object."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; safe to call twice."""

    def size_many(self, keys: Sequence[str]) -> list[int | Exception | None]:
        """:meth:`size` of each key; an exception in place of a size when its lookup failed."""
        out: list[int | Exception | None] = []
        for key in keys:
            try:
                out.append(self.size(key))
            except Exception as exc:
                out.append(exc)
        return out

    def read_many(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[ReadOutcome]:
        """:meth:`read` of leading keys into ``outs``; may stop after the first key that is
        absent or fails (the list is then shorter than ``keys``)."""
        found: list[ReadOutcome] = []
        for key, out in zip(keys, outs, strict=True):
            try:
                found.append(self.read(key, out))
            except Exception as exc:
                found.append(exc)
            if not isinstance(found[-1], tuple):
                break
        return found

    def write_many(
        self, keys: Sequence[str], headers: Sequence[bytes], payloads: Sequence[memoryview]
    ) -> list[Exception | None]:
        """:meth:`write` of each key; the error of each failed write, None for success."""
        errors: list[Exception | None] = []
        for key, header, payload in zip(keys, headers, payloads, strict=True):
            try:
                self.write(key, header, payload)
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        return errors


def split_object(data: bytes | memoryview, out: memoryview) -> tuple[bytes, str]:
    """Header and payload checksum of a whole framed object in memory; payload into ``out``."""
    view = memoryview(data)
    start = PREFIX_BYTES + header_length(view[:PREFIX_BYTES])
    payload = view[start:]
    if payload.nbytes != out.nbytes:
        raise CorruptPage(f"payload of {payload.nbytes} bytes, expected {out.nbytes}")
    return bytes(view[PREFIX_BYTES:start]), copy_hashed(payload, out)


class MemoryObjects(ObjectStore):
    """Objects in a dict of this process (tests, single-process runs)."""

    parallel_reads = False  # a copy: a second thread only adds overhead

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # guarded by _lock: key -> (framed object, logical modification time)
        self._objects: dict[str, tuple[bytes, int]] = {}
        self._clock = 0  # guarded by _lock

    def write(self, key: str, header: bytes, payload: memoryview) -> None:
        data = header + payload  # one copy: the caller's buffer may be reused
        with self._lock:
            self._clock += 1
            self._objects[key] = (data, self._clock)

    def read(self, key: str, out: memoryview) -> tuple[bytes, str] | None:
        with self._lock:
            found = self._objects.get(key)
        return None if found is None else split_object(found[0], out)

    def size(self, key: str) -> int | None:
        with self._lock:
            found = self._objects.get(key)
        return None if found is None else len(found[0])

    def remove(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def scan(self) -> Iterator[tuple[str, int, float]]:
        with self._lock:
            items = [(k, len(data), float(t)) for k, (data, t) in self._objects.items()]
        yield from items
