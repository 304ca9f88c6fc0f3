"""A storage backend over an object store: verification, byte budget, metadata cache.

Threading: every public method may run on any thread. Helper threads, started here and
stopped in :meth:`PagedBackend.close`: ``_hasher`` makes page headers ahead of the writes;
``_readers`` (``READ_AHEAD`` threads) read and hash objects ahead of the caller, who
verifies and counts them in key order (stores whose reads are plain memory copies read on
the caller's thread). ``_lock`` guards the metadata (``_meta``, ``_used_bytes``) and the
counters; object I/O runs outside it, so pipelines on several threads read and write in
parallel. Eviction picks victims under the lock (they leave the metadata at once) and
deletes them outside it.

Byte budget: a put reserves its bytes first, evicting least recently used pages until the
reservation fits; a failed write gives the reservation back. Metadata cache: a page known
to exist is trusted for ``metadata_ttl_s`` before ``exists`` asks the store again; absence
is never cached, so pages other ranks write show up at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hicache_ray.keys import ShardPlan
from hicache_ray.storage.base import StorageBackend, StorageStats
from hicache_ray.storage.objects import ObjectStore
from hicache_ray.storage.page_format import (
    CorruptPage,
    checksum,
    encode_header,
    payload_view,
    verify,
)

__all__ = ["HashedRead", "PagedBackend", "make_header"]

log = logging.getLogger(__name__)

READ_AHEAD = 2  # objects read at once by one get (reader threads)
# A verified-to-be read: header and payload checksum; an error; absent.
HashedRead = tuple[bytes, str] | Exception | None


class _Entry:
    __slots__ = ("checked_at", "num_bytes")

    def __init__(self, num_bytes: int, checked_at: float) -> None:
        self.num_bytes = num_bytes
        self.checked_at = checked_at


class PagedBackend(StorageBackend):
    """Verified pages of one namespace in an :class:`ObjectStore`."""

    def __init__(
        self,
        name: str,
        objects: ObjectStore,
        plan: ShardPlan,
        *,
        capacity_bytes: int = 0,
        metadata_ttl_s: float = 5.0,
        scan_on_start: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.objects = objects
        self.plan = plan
        self.capacity_bytes = capacity_bytes
        self.metadata_ttl_s = metadata_ttl_s
        self._clock = clock
        self._digest = plan.digest
        self._lock = threading.Lock()
        self._meta: OrderedDict[str, _Entry] = OrderedDict()  # guarded by _lock; LRU first
        self._used_bytes = 0  # guarded by _lock: known objects plus reservations
        self._counts: dict[str, int] = dict.fromkeys(  # guarded by _lock
            (f for f in StorageStats.__struct_fields__ if f not in _DERIVED), 0
        )
        self._closed = False
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix=f"hicache-{name}-hash")
        self._readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix=f"hicache-{name}-read")
        if scan_on_start:
            self._scan()

    # ------------------------------------------------------------------ interface

    def exists(self, keys: Sequence[str]) -> int:
        now, ttl, i = self._clock(), self.metadata_ttl_s, 0
        while i < len(keys):
            with self._lock:  # one acquisition for the whole run of cached keys
                meta = self._meta
                while i < len(keys):
                    entry = meta.get(keys[i])
                    if entry is None or now - entry.checked_at >= ttl:
                        break
                    i += 1
            if i == len(keys):
                break
            found = self._lookup(keys[i], now)
            if not found:
                if found is None:
                    self._count("get_failures")
                return i
            i += 1
        return len(keys)

    def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> int:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        # NOTE: READ_AHEAD objects are read (and hashed) at once on the reader threads;
        # this thread verifies and counts them in order, so the batch still stops at the
        # first page that fails, and returns only once no reader touches its buffers.
        if not self.objects.parallel_reads:
            for i, job in enumerate(zip(keys, buffers, strict=True)):
                if not self._accept(*job, self._read_one(*job)):
                    return i
            return len(keys)
        jobs = iter(zip(keys, buffers, strict=True))
        running: deque[Future[HashedRead]] = deque()

        def submit_next() -> None:
            job = next(jobs, None)
            if job is not None:
                running.append(self._readers.submit(self._read_one, *job))

        try:
            for _ in range(READ_AHEAD):
                submit_next()
            i = 0
            while running:
                outcome = running.popleft().result()
                if not self._accept(keys[i], buffers[i], outcome):
                    return i
                i += 1
                submit_next()
            return len(keys)
        finally:
            for read in running:
                if not read.cancel():
                    read.exception()  # wait: the reader may still be writing its buffer

    def _read_one(self, key: str, buf: torch.Tensor) -> HashedRead:
        """On a reader thread: read one object into ``buf`` and hash its payload."""
        out = payload_view(buf)
        try:
            found = self.objects.read(key, out)
        except Exception as exc:  # CorruptPage, or an I/O error
            return exc
        if found is None:
            return None
        header, digest = found
        return header, digest if digest is not None else checksum(out)

    def _accept(self, key: str, buf: torch.Tensor, outcome: HashedRead) -> bool:
        """Verify a read page and count it; else handle the miss, failure or corruption."""
        if outcome is None:
            with self._lock:
                self._forget(key)
            return False
        if isinstance(outcome, Exception):
            if isinstance(outcome, CorruptPage):
                self._drop_corrupt(key, outcome)
            else:
                log.warning("storage %s: reading %s failed: %s", self.name, key, outcome)
                self._count("get_failures")
            return False
        try:
            verify(outcome[0], key, self._digest, buf, outcome[1])
        except CorruptPage as exc:
            self._drop_corrupt(key, exc)
            return False
        with self._lock:
            if key in self._meta:
                self._meta.move_to_end(key)
            self._counts["get_pages"] += 1
            self._counts["get_bytes"] += buf.numel() * buf.element_size()
        return True

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        now = self._clock()
        new = [not self._lookup(key, now) for key in keys]  # a failed lookup: write anyway
        # NOTE: headers (with the payload checksum) are made on a helper thread ahead of
        # the writes, so hashing page i + 1 overlaps writing page i.
        headers = [
            self._hasher.submit(make_header, key, self._digest, page) if is_new else None
            for key, page, is_new in zip(keys, pages, new, strict=True)
        ]
        try:
            for i, (key, header) in enumerate(zip(keys, headers, strict=True)):
                if header is None:
                    with self._lock:
                        if key in self._meta:
                            self._meta.move_to_end(key)
                        self._counts["put_skipped"] += 1
                    continue
                if not self._write(key, *header.result()):
                    return i
        finally:
            for header in headers:
                if header is not None:
                    header.cancel()
        return len(keys)

    def _write(self, key: str, header: bytes, payload: memoryview) -> bool:
        size = len(header) + payload.nbytes
        victims = self._reserve(size)
        if victims is None:
            self._refuse_oversized(size)
            return False
        self._remove_objects(victims)
        try:
            self.objects.write(key, header, payload)
        except Exception as exc:
            log.warning("storage %s: writing %s failed: %s", self.name, key, exc)
            with self._lock:
                self._used_bytes -= size
                self._counts["put_failures"] += 1
            return False
        with self._lock:
            self._used_bytes -= size  # the reservation becomes the entry
            self._remember(key, size, self._clock())
            self._counts["put_pages"] += 1
            self._counts["put_bytes"] += payload.nbytes
        return True

    def delete(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._forget(key)
        self._remove_objects(list(keys))

    def stats(self) -> StorageStats:
        with self._lock:
            return StorageStats(
                backend=self.name,
                num_objects=len(self._meta),
                stored_bytes=sum(e.num_bytes for e in self._meta.values()),
                capacity_bytes=self.capacity_bytes,
                **self._counts,
            )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hasher.shutdown(wait=True, cancel_futures=True)
            self._readers.shutdown(wait=True, cancel_futures=True)
            self.objects.close()

    def check_integrity(self) -> None:
        """Known bytes equal the sum of entries (no reservation outstanding when idle)."""
        with self._lock:
            total = sum(e.num_bytes for e in self._meta.values())
            assert self._used_bytes == total, f"used {self._used_bytes} != entries {total}"
            assert not self.capacity_bytes or total <= self.capacity_bytes, "over capacity"

    # ------------------------------------------------------------------ internals

    def _lookup(self, key: str, now: float) -> bool | None:
        """Whether ``key`` is stored (cached for the TTL); None when the store failed."""
        with self._lock:
            entry = self._meta.get(key)
            if entry is not None and now - entry.checked_at < self.metadata_ttl_s:
                return True
        try:
            size = self.objects.size(key)
        except Exception as exc:  # an unreachable store is a miss, never an error
            log.warning("storage %s: looking up %s failed: %s", self.name, key, exc)
            return None
        with self._lock:
            if size is None:
                self._forget(key)
                return False
            self._remember(key, size, now)
            return True

    def _refuse_oversized(self, size: int) -> None:
        log.warning(
            "storage %s: a %d-byte page does not fit capacity_bytes=%d",
            self.name,
            size,
            self.capacity_bytes,
        )
        self._count("put_failures")

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _remember(self, key: str, size: int, now: float) -> None:
        """Record ``key`` as present (caller holds ``_lock``)."""
        entry = self._meta.get(key)
        if entry is None:
            self._meta[key] = _Entry(size, now)
            self._used_bytes += size
        else:
            self._used_bytes += size - entry.num_bytes
            entry.num_bytes, entry.checked_at = size, now
            self._meta.move_to_end(key)

    def _forget(self, key: str) -> None:
        """Drop ``key`` from the metadata (caller holds ``_lock``)."""
        entry = self._meta.pop(key, None)
        if entry is not None:
            self._used_bytes -= entry.num_bytes

    def _reserve(self, size: int) -> list[str] | None:
        """Reserve ``size`` bytes; returns the evicted keys, or None when it cannot fit."""
        with self._lock:
            if not self.capacity_bytes:
                self._used_bytes += size
                return []
            if size > self.capacity_bytes:
                return None
            victims = []
            while self._used_bytes + size > self.capacity_bytes and self._meta:
                key, entry = self._meta.popitem(last=False)
                self._used_bytes -= entry.num_bytes
                victims.append(key)
            if self._used_bytes + size > self.capacity_bytes:  # reservations in flight
                return None
            self._used_bytes += size
            self._counts["evicted_pages"] += len(victims)
            return victims

    def _remove_objects(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.objects.remove(key)
            except Exception as exc:
                log.warning("storage %s: deleting %s failed: %s", self.name, key, exc)

    def _drop_corrupt(self, key: str, exc: CorruptPage) -> None:
        log.warning(
            "storage %s: page %s failed verification (%s); deleting it", self.name, key, exc
        )
        with self._lock:
            self._forget(key)
            self._counts["corrupt_pages"] += 1
        self._remove_objects([key])

    def _scan(self) -> None:
        found = sorted(
            (mtime, key, size) for key, size, mtime in self.objects.scan() if self.plan.owns(key)
        )
        now = self._clock()
        with self._lock:
            for _, key, size in found:
                self._remember(key, size, now)
        self._remove_objects(self._reserve(0) or [])  # reserving nothing evicts down to budget
        log.info("storage %s: found %d pages of this namespace", self.name, len(found))


def make_header(key: str, digest: str, page: torch.Tensor) -> tuple[bytes, memoryview]:
    """The framed header of ``page`` (with its payload checksum) and its payload view."""
    payload = payload_view(page)
    return encode_header(key, digest, page, payload), payload


_DERIVED = ("backend", "num_objects", "stored_bytes", "capacity_bytes")
