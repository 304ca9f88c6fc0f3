"""A paged backend over a remote store: one round trip per batch, not one per page.

:class:`PagedBackend` asks its store key by key, which is right for a filesystem (each
page is its own file and reads run ahead on threads) and wrong for a store behind an RPC,
where every call costs a round trip. :class:`BatchedBackend` keeps the same verification,
budget and metadata cache and talks to the store through its ``*_many`` methods:
``exists`` asks for every uncached key of the batch at once, ``put`` looks up and writes the
whole batch in one call each, ``get`` reads the batch in one call and verifies the pages in
key order, stopping at the first that fails (the store may stop early too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hicache_ray.storage.page_format import checksum, payload_view
from hicache_ray.storage.paged import HashedRead, PagedBackend, make_header

__all__ = ["BatchedBackend"]

log = logging.getLogger(__name__)


class BatchedBackend(PagedBackend):
    """:class:`PagedBackend` whose store calls are batched (see the module docstring)."""

    def exists(self, keys: Sequence[str]) -> int:
        present = self._lookup_many(keys)
        for i, found in enumerate(present):
            if not found:
                if found is None:
                    self._count("get_failures")
                return i
        return len(keys)

    def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> int:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        outs = [payload_view(b) for b in buffers]
        try:
            outcomes = self.objects.read_many(keys, outs)
        except Exception as exc:  # the store is unreachable: a miss, never an error
            log.warning("storage %s: reading %d pages failed: %s", self.name, len(keys), exc)
            self._count("get_failures")
            return 0
        for i, found in enumerate(outcomes):
            outcome: HashedRead = found  # type: ignore[assignment]
            if isinstance(found, tuple):
                outcome = found[0], found[1] if found[1] is not None else checksum(outs[i])
            if not self._accept(keys[i], buffers[i], outcome):
                return i
        return len(outcomes)

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        present = self._lookup_many(keys)  # a failed lookup: write anyway
        new = [i for i, found in enumerate(present) if not found]
        framed = list(self._hasher.map(lambda i: make_header(keys[i], self._digest, pages[i]), new))
        # Reserve in key order; a page that cannot fit ends the batch.
        reserved: list[int] = []
        for i, (header, payload) in zip(new, framed, strict=True):
            victims = self._reserve(len(header) + payload.nbytes)
            if victims is None:
                self._refuse_oversized(len(header) + payload.nbytes)
                break
            self._remove_objects(victims)
            reserved.append(i)
        errors = self.objects.write_many(
            [keys[i] for i in reserved],
            [framed[j][0] for j in range(len(reserved))],
            [framed[j][1] for j in range(len(reserved))],
        )
        stored = len(keys) if len(reserved) == len(new) else new[len(reserved)]
        now = self._clock()
        with self._lock:
            for j, (i, error) in enumerate(zip(reserved, errors, strict=True)):
                header, payload = framed[j]
                size = len(header) + payload.nbytes
                self._used_bytes -= size  # the reservation becomes an entry, or is given back
                if error is not None:
                    self._counts["put_failures"] += 1
                    stored = min(stored, i)
                    continue
                self._remember(keys[i], size, now)
                self._counts["put_pages"] += 1
                self._counts["put_bytes"] += payload.nbytes
            for i, found in enumerate(present):
                if found and i < stored:
                    if keys[i] in self._meta:
                        self._meta.move_to_end(keys[i])
                    self._counts["put_skipped"] += 1
        if stored < len(keys) and stored in reserved:
            failed = errors[reserved.index(stored)]
            log.warning("storage %s: writing %s failed: %s", self.name, keys[stored], failed)
        return stored

    def _lookup_many(self, keys: Sequence[str]) -> list[bool | None]:
        """Whether each key is stored (cached answers within the TTL, the rest asked in
        one call); None for a key whose lookup failed."""
        now = self._clock()
        found: list[bool | None] = [False] * len(keys)
        ask: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._meta.get(key)
                if entry is not None and now - entry.checked_at < self.metadata_ttl_s:
                    found[i] = True
                else:
                    ask.append(i)
        if not ask:
            return found
        try:
            sizes = self.objects.size_many([keys[i] for i in ask])
        except Exception as exc:
            log.warning("storage %s: looking up %d pages failed: %s", self.name, len(ask), exc)
            sizes = [exc] * len(ask)
        with self._lock:
            for i, size in zip(ask, sizes, strict=True):
                if isinstance(size, Exception):
                    found[i] = None
                elif size is None:
                    self._forget(keys[i])
                else:
                    self._remember(keys[i], size, now)
                    found[i] = True
        return found
