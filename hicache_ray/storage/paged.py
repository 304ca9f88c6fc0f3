"""The storage backend over an object store: trust at the edge, verification, budget, cache.

What is checked where:

* **The caller's input** (every method): keys must be ``str`` of the key grammar
  (:func:`~hicache_ray.keys.check_keys`), so none can name a path outside the store; the
  buffers of ``get`` and the pages of ``put`` must be CPU tensors of exactly the dtype and
  shape the plan gives their key, the pages contiguous (a buffer may be a strided view:
  its place in a pool laid out otherwise, filled in one pass). A mismatch is the caller's mistake: a
  ``ValueError`` naming what was expected and what came, raised before any I/O, counted in
  ``refused_pages``; nothing is read, written or deleted.
* **The stored object** (``get``): frame, format version, namespace digest, key, dtype,
  shape, payload length and checksum (:func:`~hicache_ray.storage.page_format.verify`).
  Only a fault there makes a miss: the object is deleted and counted in ``corrupt_pages``.
  A store that copies on threads of its own verifies each page there, right after its copy
  (``read_many``'s ``check``); every other page is verified here.
  A page that fails ends the batch; every buffer past the returned count is zero-filled
  before ``get`` returns (read-ahead included), so no unverified byte is left in a caller's buffer
  (prefetches read into host-pool slots).

Threading: every public method may run on any thread. ``_lock`` guards the index and the
counters; object I/O runs outside it, so pipelines on several threads read and write in
parallel. ``_hasher`` makes page headers (with their checksums) ahead of the writes.
Eviction picks victims under the lock (they leave the index at once) and deletes them
outside it. Batches end at their first failed lookup, read or write, so a dead store costs
one store timeout per batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

import torch

from hicache_ray.base.layout import DTYPES
from hicache_ray.base.views import byte_view
from hicache_ray.keys import ShardPlan, check_keys
from hicache_ray.storage.base import PreparedRead, StorageBackend, StorageStats
from hicache_ray.storage.index import PageIndex
from hicache_ray.storage.objects import ObjectStore, ReadOutcome
from hicache_ray.storage.page_format import (
    CorruptPage,
    FutureHeaders,
    HeaderArgs,
    LazyHeaders,
    ReadOut,
    StridedOut,
    checksum_of,
    encode_header,
    framed_size,
    tensor_problem,
    verify,
    zero_out,
)
from hicache_ray.storage.paged_writes import PageWrites
from hicache_ray.storage.read_set import ReadSet, RowBuffers, check_row_read, row_outs, rows_problem

__all__ = ["PagedBackend"]

log = logging.getLogger(__name__)

_COUNTERS = tuple(
    f
    for f in StorageStats.__struct_fields__
    if f not in ("backend", "num_objects", "stored_bytes", "capacity_bytes")
)


class PagedBackend(PageWrites, StorageBackend):
    """Verified pages of one namespace in an :class:`ObjectStore` (see the module docstring)."""

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
        self._clock = clock
        self._digest = plan.digest
        self._lock = threading.Lock()
        self._index = PageIndex(capacity_bytes, metadata_ttl_s)  # guarded by _lock
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)  # guarded by _lock
        self._closed = False
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix=f"hicache-{name}-hash")
        if scan_on_start:
            self._scan()

    # ------------------------------------------------------------------ interface

    def exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        now = self._clock()
        with self._lock:
            i = 0
            while i < len(keys) and self._index.fresh(keys[i], now):
                i += 1
        if i == len(keys):
            return i
        try:
            sizes = self.objects.size_many(keys[i:])
        except Exception as exc:  # an unreachable store is a miss, never an error
            sizes = [exc]
        with self._lock:
            for key, size in zip(keys[i:], sizes, strict=False):
                if isinstance(size, Exception):
                    log.warning("storage %s: looking up %s failed: %s", self.name, key, size)
                    self._counts["get_failures"] += 1
                    return i
                if size is None:
                    # NOTE: the key seen absent is not asked again by the next put of it.
                    # The keys after it were not answered (a leading lookup stops here):
                    # nothing is assumed.
                    self._index.forget(key)
                    self._index.note_absent(key, now)
                    return i
                self._index.remember(key, size, now)
                i += 1
        return i

    def exists_each(self, keys: Sequence[str]) -> list[bool]:
        check_keys(keys)
        found = self._present(keys)  # shorter when a lookup failed: the rest unknown
        now = self._clock()
        with self._lock:
            for key, present in zip(keys, found, strict=False):
                if not present:  # the put that follows does not ask again
                    self._index.note_absent(key, now)
        return found + [False] * (len(keys) - len(found))

    @property
    def reads_in_parallel(self) -> bool:
        return self.objects.reads_in_parallel

    def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> int:
        return self.get_prepared(self.prepare_get(keys, buffers), len(keys))

    def prepare_get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> PreparedRead:
        """Checks the buffers and makes their copy destinations (about 6 us an object; a
        pool's reads go through :meth:`prepare_get_rows`)."""
        shapes = self._check_tensors("buffer", keys, buffers)
        outs = [byte_view(b) if b.is_contiguous() else StridedOut(b) for b in buffers]
        return PreparedRead(keys, buffers, ReadSet(outs, shapes))

    def prepare_get_rows(
        self, keys: Sequence[str], rows: Sequence[torch.Tensor], slots: Sequence[int]
    ) -> PreparedRead:
        check_row_read(keys, rows, slots)
        check_keys(keys)  # each key's object is checked by its suffix, each row tensor once
        problem = rows_problem(self.plan, self.plan_dtype, keys, rows)
        if problem is not None:
            self._refuse(f"storage {self.name}: {problem}")
        shapes = [tuple(r.shape[1:]) for r in rows] * len(slots)
        return PreparedRead(keys, RowBuffers(rows, slots), ReadSet(row_outs(rows, slots), shapes))

    def get_prepared(self, read: PreparedRead, count: int) -> int:
        if not 0 <= count <= len(read.keys) or not isinstance(read.state, ReadSet):
            raise ValueError(f"count {count} outside [0, {len(read.keys)}], or not prepared here")
        keys, outs, shapes = read.keys[:count], read.state.outs[:count], read.state.shapes[:count]
        verified: set[int] = set()  # the pages the store's copy threads verified
        dtype = self.plan_dtype

        def check(i: int, header: bytes, digest: str) -> None:
            verify(header, keys[i], self._digest, dtype, shapes[i], digest)
            verified.add(i)

        try:
            if self.objects.reads_in_parallel:
                outcomes = self.objects.read_many(keys, outs, check)
            else:
                outcomes = self.objects.read_many(keys, outs)
        except Exception as exc:  # the store is unreachable: a miss, never an error
            outcomes = [exc] * len(keys)  # whatever it wrote before failing is zeroed below
        done = len(outcomes)
        for i, outcome in enumerate(outcomes):
            if i in verified:  # read and verified on the store's copy thread
                continue
            if not self._accept(keys[i], shapes[i], outs[i], outcome):
                done = i
                if isinstance(outcome, Exception) and not isinstance(outcome, CorruptPage):
                    # The store failed (a shard restarting, a network error): what the
                    # metadata cache says of the rest of the batch is in doubt too.
                    with self._lock:
                        for key in keys[i:]:
                            self._index.forget(key)
                break
        self._count_read(keys[:done], outs[:done])
        # NOTE: every buffer past the count, not only those of the outcomes returned: a
        # store may have read ahead into buffers past the key that ended the batch.
        for out in outs[done:]:
            zero_out(out)
        return min(done, len(keys))

    def put(
        self,
        keys: Sequence[str],
        pages: Sequence[torch.Tensor],
        checksums: Sequence[str] | None = None,
        *,
        unseen: bool = False,
        owner: str = "",
    ) -> int:
        """See :meth:`StorageBackend.put` (``owner`` goes to :meth:`ObjectStore.write_owned`).

        Args:
            checksums: the pages' payload checksums when the caller computed them while the
                bytes were in cache (an integration that copies pages out of a pool of
                another layout); a wrong one stores a page that every read then rejects as
                corrupt, never a wrong page.
            unseen: the caller knows the pages were not stored when it last looked (it
                computed them after a lookup missed them), so the store is not asked again:
                a page another writer stored since is written once more (the same bytes
                under the same name; the store keeps one).
        """
        self._check_tensors("page", keys, pages)
        if checksums is not None and len(checksums) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(checksums)} checksums")
        known = [False] * len(keys) if unseen else self._present(keys)
        # Keys before a failed lookup are known present or absent; the batch ends there.
        new = [i for i in range(len(known)) if known[i] is False]
        with self._lock:
            for i in range(len(known)):
                if known[i]:
                    self._index.touch(keys[i])
                    self._counts["put_skipped"] += 1
        payloads = [byte_view(pages[i]) for i in new]
        headers, sizes = self._headers(keys, pages, checksums, new, payloads)
        reserved = self._reserve(sizes)
        try:
            args = [keys[i] for i in new[:reserved]], headers[:reserved], payloads[:reserved]
            if owner:
                errors = self.objects.write_owned(*args, owner)
            else:
                errors = self.objects.write_many(*args)
        except Exception as exc:  # the store is unreachable: nothing written
            errors = [exc]
        finally:
            if isinstance(headers, FutureHeaders):
                headers.cancel()
        stored = self._settle_writes(keys, new, sizes, payloads, reserved, errors)
        return min(stored, len(known))

    def _headers(
        self,
        keys: Sequence[str],
        pages: Sequence[torch.Tensor],
        checksums: Sequence[str] | None,
        new: list[int],
        payloads: list[memoryview],
    ) -> tuple[Sequence[bytes], list[int]]:
        """The new pages' headers (made ahead on the hasher thread where the store allows
        it, see :attr:`ObjectStore.hash_ahead`, else as the store asks for them) and framed
        sizes."""
        args: list[HeaderArgs] = [
            (keys[i], self._digest, pages[i], payload, None if checksums is None else checksums[i])
            for i, payload in zip(new, payloads, strict=True)
        ]
        sizes = [framed_size(*a[:4]) for a in args]
        if not self.objects.hash_ahead:
            return LazyHeaders(args), sizes
        return FutureHeaders([self._hasher.submit(encode_header, *a) for a in args]), sizes

    def delete(self, keys: Sequence[str]) -> None:
        check_keys(keys)
        with self._lock:
            for key in keys:
                self._index.forget(key)
        self._remove(list(keys))

    def stats(self) -> StorageStats:
        with self._lock:
            return StorageStats(
                backend=self.name,
                num_objects=len(self._index),
                stored_bytes=self._index.stored_bytes,
                capacity_bytes=self.capacity_bytes,
                **self._counts,
            )

    def flush(self) -> None:
        self.objects.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hasher.shutdown(wait=True, cancel_futures=True)
            self.objects.close()

    def check_integrity(self) -> None:
        """The index's accounting holds (no reservation is outstanding when idle)."""
        with self._lock:
            self._index.check_integrity()
            assert self._index.reserved_bytes == 0, "a reservation outlived its put"

    # ------------------------------------------------------------------ checks

    def _check_tensors(
        self, what: str, keys: Sequence[str], tensors: Sequence[torch.Tensor]
    ) -> list[tuple[int, ...]]:
        """The caller's keys and buffers (or pages) against the plan, before any I/O; the
        shape of each key's object."""
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} {what}s")
        check_keys(keys)
        dtype = self.plan_dtype
        shapes = []
        for i, (key, t) in enumerate(zip(keys, tensors, strict=True)):
            spec = self.plan.spec_of(key)
            if spec is None:
                problem: str | None = (
                    f"key {key} is not one of this rank's objects ({self.plan.tag})"
                )
            else:
                problem = tensor_problem(t, dtype, spec.shape, contiguous=what == "page")
            if problem is not None:
                self._refuse(f"storage {self.name}: {what} {i} for {key}: {problem}")
            shapes.append(spec.shape if spec is not None else ())
        return shapes

    def _refuse(self, message: str) -> NoReturn:
        """Count a refused call and raise its ``ValueError``."""
        with self._lock:
            self._counts["refused_pages"] += 1
        raise ValueError(message)

    @property
    def plan_dtype(self) -> torch.dtype:
        return DTYPES[self.plan.namespace.dtype]

    # ------------------------------------------------------------------ reads

    def _accept(self, key: str, shape: tuple[int, ...], out: ReadOut, outcome: ReadOutcome) -> bool:
        """Verify a read page the store's copy thread did not; else handle the miss,
        failure or corruption."""
        if outcome is None:
            with self._lock:
                self._index.forget(key)
            return False
        if isinstance(outcome, Exception):
            if isinstance(outcome, CorruptPage):
                self._drop_corrupt(key, outcome)
            else:
                log.warning("storage %s: reading %s failed: %s", self.name, key, outcome)
                with self._lock:
                    self._counts["get_failures"] += 1
            return False
        header, digest = outcome
        try:
            digest = digest if digest is not None else checksum_of(out)
            verify(header, key, self._digest, self.plan_dtype, shape, digest)
        except CorruptPage as exc:
            self._drop_corrupt(key, exc)
            return False
        return True

    def _count_read(self, keys: Sequence[str], outs: Sequence[ReadOut]) -> None:
        """The pages read: recently used, counted (one lock for the batch: per page it cost
        a 512-object hit about 1 ms)."""
        with self._lock:
            for key in keys:
                self._index.touch(key)
            self._counts["get_pages"] += len(keys)
            self._counts["get_bytes"] += sum(out.nbytes for out in outs)

    def _drop_corrupt(self, key: str, exc: CorruptPage) -> None:
        log.warning(
            "storage %s: page %s failed verification (%s); deleting it", self.name, key, exc
        )
        with self._lock:
            self._index.forget(key)
            self._counts["corrupt_pages"] += 1
        self._remove([key])

    # ------------------------------------------------------------------ plumbing

    def _scan(self) -> None:
        found = sorted(
            (mtime, key, size) for key, size, mtime in self.objects.scan() if self.plan.owns(key)
        )
        now = self._clock()
        with self._lock:
            for _, key, size in found:
                self._index.remember(key, size, now)
            victims = self._index.evict_to(self.capacity_bytes) if self.capacity_bytes else []
        self._remove(victims)
        log.info("storage %s: found %d pages of this namespace", self.name, len(found))
