"""Object stores: the dumb byte layer under the paged backend.

An object store keeps framed page objects (see :mod:`page_format`) by key and knows nothing
of namespaces, checksums or budgets; :class:`~hicache_ray.storage.paged.PagedBackend` adds
those. Splitting the two lets one fault injector (:mod:`faults`) sit between them and
corrupt, truncate, fail or delay real stored bytes for every store alike.

The interface is batch-only: a remote store answers a whole batch in one round trip, a
filesystem reads ahead on its own threads, and every batch ends at its first failure, so a
dead store costs one timeout per batch, not one per key. Keys reach a store only after the
backend checked them against the key grammar. Every method is thread-safe; a write is
atomic (a reader sees the whole object or none of it).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

from hicache_ray.storage.page_format import (
    PREFIX_BYTES,
    CorruptPage,
    ReadOut,
    copy_hashed,
    header_length,
)

__all__ = [
    "MemoryObjects",
    "ObjectStore",
    "PageCheck",
    "ReadOutcome",
    "SizeOutcome",
    "split_object",
]

# One object's read: (header bytes, checksum of the payload as read, or None for "not
# hashed: hash the buffer"), the error that ended the batch there, or None when absent.
ReadOutcome = tuple[bytes, str | None] | Exception | None
# One key's lookup: stored bytes, None when absent, or the error that ended the batch there.
SizeOutcome = int | Exception | None
# Verifies the page a read copied (its index in the batch, header bytes, payload checksum as
# copied); raises CorruptPage (see ObjectStore.read_many).
PageCheck = Callable[[int, bytes, str], None]


class ObjectStore(ABC):
    """A keyed store of framed page objects, called in batches.

    Each ``*_many`` answers in key order and may stop after the first key that fails (the
    answer is then shorter than ``keys`` and the failure is its last entry), never skip one
    and go on; reads (and leading lookups) stop after the first absent key too.
    """

    #: Headers (their payload checksums) are made on a helper thread while earlier pages
    #: are written. A store whose writes hold the GIL between short releases (``ray.put``
    #: slows down many times beside a busy Python thread) hashes on the writing thread.
    hash_ahead: bool = True
    #: One ``read_many`` copies its payloads on several threads of its own.
    reads_in_parallel: bool = False

    @abstractmethod
    def size_many(self, keys: Sequence[str], leading: bool = True) -> list[SizeOutcome]:
        """Stored bytes of each key, None when absent; stops after the first failed key,
        and with ``leading`` (what ``exists`` needs) after the first absent one too."""

    @abstractmethod
    def read_many(
        self, keys: Sequence[str], outs: Sequence[ReadOut], check: PageCheck | None = None
    ) -> list[ReadOutcome]:
        """Read the leading objects, each payload into its ``out`` (contiguous bytes, or a
        :class:`StridedOut`: the payload's place in a buffer laid out otherwise); stops
        after the first key that is absent or fails. A payload not exactly ``out.nbytes``
        long, or a malformed frame, is a :class:`CorruptPage` in its place. Returns once
        nothing touches ``outs`` any more; ``outs`` past the returned outcomes may hold
        bytes read ahead (unverified: :class:`PagedBackend` zero-fills them).

        ``check``: a store that copies on threads of its own (``reads_in_parallel``) may
        call it on the copying thread for each page it copied and hashed, so that one
        page's verification overlaps the other pages' copies; a page it raises
        :class:`CorruptPage` for is that error in its place. The caller verifies the pages
        it was not called for. A store that changes bytes after an inner store read them
        (fault injection) must not pass it on."""

    @abstractmethod
    def write_many(
        self, keys: Sequence[str], headers: Sequence[bytes], payloads: Sequence[memoryview]
    ) -> list[Exception | None]:
        """Write ``header + payload`` under each key in order; None for each success,
        stopping after the first failure (its error is the last entry)."""

    def write_owned(
        self,
        keys: Sequence[str],
        headers: Sequence[bytes],
        payloads: Sequence[memoryview],
        owner: str,
    ) -> list[Exception | None]:
        """:meth:`write_many` of pages a tenant ``owner`` owns (``""``: none); a store that
        keeps quotas per owner overrides it, the others ignore the owner."""
        return self.write_many(keys, headers, payloads)

    @abstractmethod
    def remove_many(self, keys: Sequence[str]) -> None:
        """Delete ``keys``; absent keys are ignored. Raises on I/O errors."""

    @abstractmethod
    def scan(self) -> Iterator[tuple[str, int, float]]:
        """``(key, bytes, modification time)`` of every stored object."""

    def flush(self) -> None:  # noqa: B027 - optional hook, most stores write through
        """Wait until what was written so far is as durable as this store makes it."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release resources; safe to call twice."""


def split_object(data: bytes | memoryview, out: ReadOut) -> tuple[bytes, str]:
    """Header and payload checksum of a whole framed object in memory; payload into ``out``."""
    view = memoryview(data)
    start = PREFIX_BYTES + header_length(view[:PREFIX_BYTES])
    payload = view[start:]
    if payload.nbytes != out.nbytes:
        raise CorruptPage(f"payload of {payload.nbytes} bytes, expected {out.nbytes}")
    return bytes(view[PREFIX_BYTES:start]), copy_hashed(payload, out)


class MemoryObjects(ObjectStore):
    """Objects in a dict of this process (tests, single-process runs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # guarded by _lock: key -> (framed object, logical modification time)
        self._objects: dict[str, tuple[bytes, int]] = {}
        self._clock = 0  # guarded by _lock

    def size_many(self, keys: Sequence[str], leading: bool = True) -> list[SizeOutcome]:
        out: list[SizeOutcome] = []
        with self._lock:
            for key in keys:
                found = self._objects.get(key)
                out.append(None if found is None else len(found[0]))
                if found is None and leading:
                    break
        return out

    def read_many(
        self, keys: Sequence[str], outs: Sequence[ReadOut], check: PageCheck | None = None
    ) -> list[ReadOutcome]:
        found: list[ReadOutcome] = []
        for key, out in zip(keys, outs, strict=True):
            with self._lock:
                entry = self._objects.get(key)
            if entry is None:
                found.append(None)
                break
            try:
                found.append(split_object(entry[0], out))
            except CorruptPage as exc:
                found.append(exc)
                break
        return found

    def write_many(
        self, keys: Sequence[str], headers: Sequence[bytes], payloads: Sequence[memoryview]
    ) -> list[Exception | None]:
        for key, header, payload in zip(keys, headers, payloads, strict=True):
            data = header + payload  # one copy: the caller's buffer may be reused
            with self._lock:
                self._clock += 1
                self._objects[key] = (data, self._clock)
        return [None] * len(keys)

    def remove_many(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    def scan(self) -> Iterator[tuple[str, int, float]]:
        with self._lock:
            items = [(k, len(data), float(t)) for k, (data, t) in self._objects.items()]
        yield from items
