"""The L3 storage interface every backend implements.

Narrow, batched and synchronous: asynchrony belongs to the pipelines that call it. Pages
are contiguous CPU tensors (``[L, S, P, H, D]`` objects of a :class:`~hicache_ray.keys.ShardPlan`);
keys come from the plan. Counts are of *leading* keys: a batch stops at the first key that
is missing, unreadable or fails, so a caller never gets a prefix with holes.

A caller's mistake (a key outside the key grammar, a buffer or page of the wrong dtype,
shape, device or layout) raises ``ValueError`` before any I/O and never touches a stored
page; only a fault in a stored object makes a miss (and deletes that object). A dead store
fails a batch within about one store timeout, whatever the batch size.

Every method is thread-safe: pipelines on different threads may call one backend at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import msgspec
import torch

__all__ = ["PreparedRead", "StorageBackend", "StorageStats"]


class StorageStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one backend's counters.

    Attributes:
        backend: registered name.
        num_objects, stored_bytes: what this instance knows to be stored (for shared
            filesystems, what it wrote or found at start-up / on lookups).
        capacity_bytes: byte budget; 0 means none.
        put_pages, put_bytes, get_pages, get_bytes: pages and bytes moved.
        put_skipped: puts of keys already present (touched, not rewritten).
        put_failures, get_failures: operations that raised in the filesystem / store.
        corrupt_pages: objects that failed verification (each was deleted, read as a miss).
        evicted_pages: objects removed by the byte budget.
        refused_pages: buffers or pages a caller passed that did not match the plan
            (wrong dtype, shape, device or layout; refused with ``ValueError``, no I/O).
    """

    backend: str
    num_objects: int = 0
    stored_bytes: int = 0
    capacity_bytes: int = 0
    put_pages: int = 0
    put_bytes: int = 0
    put_skipped: int = 0
    get_pages: int = 0
    get_bytes: int = 0
    put_failures: int = 0
    get_failures: int = 0
    corrupt_pages: int = 0
    evicted_pages: int = 0
    refused_pages: int = 0


class PreparedRead:
    """A read checked and set up ahead of the store's answer (:meth:`StorageBackend.prepare_get`):
    its keys, buffers and what the backend made of them (``state``)."""

    __slots__ = ("buffers", "keys", "state")

    def __init__(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor], state: object = None
    ) -> None:
        from hicache_ray.storage.read_set import RowBuffers  # views made when asked for

        self.keys, self.state = list(keys), state
        self.buffers = buffers if isinstance(buffers, RowBuffers) else list(buffers)


class StorageBackend(ABC):
    """Shared page storage (L3). Implementations are named in :mod:`hicache_ray.base.backends`."""

    name: str = "abstract"

    @property
    def reads_in_parallel(self) -> bool:
        """Whether one :meth:`get` already copies its pages on several threads (a caller
        that splits a batch over threads of its own then only oversubscribes the cores)."""
        return False

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` present (stops at the first absent key).

        May answer from a metadata cache; a page reported present can still turn out
        missing or corrupt on :meth:`get`, which then returns a shorter count.

        Raises:
            ValueError: a key is not a ``str`` of the key grammar.
        """

    def exists_each(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present, all of them answered in one lookup (a backup asks
        this once and writes only the absent pages). This default answers from
        :meth:`exists`: the keys after the first absent one read as absent (a write of a
        present page is skipped by ``put`` anyway).

        Raises:
            ValueError: a key is not a ``str`` of the key grammar.
        """
        n = self.exists(keys)
        return [True] * n + [False] * (len(keys) - n)

    @abstractmethod
    def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> int:
        """Read leading pages into ``buffers`` (CPU tensors of each page's dtype and shape:
        contiguous, or a strided view of a pool, filled in one strided pass) and verify
        them; returns how many leading pages are valid.

        Buffers past the returned count are zero-filled (never unverified bytes, whatever
        the store read ahead). A page that fails verification is deleted and
        counted in ``corrupt_pages``; it ends the batch. Never raises for a missing,
        corrupt or unreadable page.

        Raises:
            ValueError: a bad key, or a buffer that does not match its key's object in the
                plan (nothing is read or deleted).
        """

    def prepare_get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> PreparedRead:
        """Check and set up a :meth:`get` of ``keys`` into ``buffers`` before it can run (a
        prefetch prepares its read while its lookup waits for the store); then
        :meth:`get_prepared` reads its leading keys. This default checks nothing ahead.

        Raises:
            ValueError: as :meth:`get` (backends that check ahead).
        """
        return PreparedRead(keys, buffers)

    def prepare_get_rows(
        self, keys: Sequence[str], rows: Sequence[torch.Tensor], slots: Sequence[int]
    ) -> PreparedRead:
        """:meth:`prepare_get` into a pool's pages: ``rows`` holds one tensor per object of
        a page (``[pages, *object shape]``, as :meth:`HostPool.object_rows` gives), ``keys``
        the objects page by page, and page ``j``'s object ``i`` (key ``j * len(rows) + i``)
        is read into ``rows[i][slots[j]]``. Backends that check ahead check each row
        tensor once, not each object.

        Raises:
            ValueError: as :meth:`prepare_get`; keys not ``len(rows)`` per slot, or a slot
                outside the rows.
        """
        from hicache_ray.storage.read_set import RowBuffers, check_row_read

        check_row_read(keys, rows, slots)
        return self.prepare_get(keys, RowBuffers(rows, slots)[:])

    def get_prepared(self, read: PreparedRead, count: int) -> int:
        """:meth:`get` of the first ``count`` keys of ``read`` (0 <= ``count`` <= its keys);
        the buffers past them are not touched."""
        if not 0 <= count <= len(read.keys):
            raise ValueError(f"count {count} outside [0, {len(read.keys)}]")
        return self.get(read.keys[:count], read.buffers[:count])

    @abstractmethod
    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor], *, owner: str = "") -> int:
        """Store leading pages; returns how many leading pages are stored.

        ``owner`` tags the pages with a tenant (:func:`hicache_ray.serving.tenants.owner_of`)
        whose L3 quota they count against, where the store keeps quotas (the ``ray`` store);
        others ignore it.

        A key already present is not rewritten (its recency is refreshed). A failed
        lookup or write (full disk, permissions, network) ends the batch and is counted;
        it does not raise. Readers never see a partly written page.

        Raises:
            ValueError: a bad key, or a page that does not match its key's object in the
                plan (nothing is stored).
        """

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove ``keys``; absent keys are ignored. Raises ``ValueError`` for a bad key."""

    @abstractmethod
    def stats(self) -> StorageStats:
        """A snapshot of the counters."""

    def flush(self) -> None:  # noqa: B027 - optional hook, most backends write through
        """Wait until the pages stored so far are as durable as this backend makes them
        (the ``ray`` store: owned by its shards, so they outlive their writer)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release resources; safe to call twice."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
