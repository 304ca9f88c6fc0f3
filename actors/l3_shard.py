"""One index shard of the object-store L3: it owns page objects and maps keys to them.

Pages must outlive the rank and the deployment that wrote them, and a Ray object lives as
long as its owner (the process that put it). So a writer sends its pages to the shard,
which calls ``ray.put`` itself: the shard, a named detached actor, owns every object of its
keys. Pages of one put arrive together and become one object (a list alternating each
page's framed header and its payload array), so an object holds several MiB, not one page:
a Ray object per page would cost about 0.6 ms per put here.

The index maps key -> (object, item). Budget: ``capacity_bytes`` bounds the bytes of the
objects this shard owns; a put evicts least recently used objects (whole objects: dropping
the last reference is what frees object-store memory) until the new one fits. Lookups
by ``locate`` refresh an object's recency. Methods run on several actor threads at once;
``_lock`` guards the index, ``ray.put`` runs outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from typing import Any

import ray

__all__ = ["PageShard"]


class _Object:
    __slots__ = ("keys", "live", "nbytes", "ref", "stored_at")

    def __init__(self, ref: Any, nbytes: int, keys: list[str]) -> None:
        self.ref = ref
        self.nbytes = nbytes
        self.keys = keys  # item i // 2 holds keys[i]
        self.live = len(keys)  # keys still indexed to this object
        self.stored_at = time.time()


class PageShard:
    """The actor class (created by :mod:`actors.ray_store` as a named detached actor).

    Args:
        num_shards: how many shards the store has (users check they agree).
        capacity_bytes: most bytes of objects this shard keeps; 0 for no limit.
    """

    def __init__(self, num_shards: int, capacity_bytes: int) -> None:
        self.num_shards = num_shards
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._objects: OrderedDict[int, _Object] = OrderedDict()  # guarded; LRU first
        self._index: dict[str, tuple[int, int]] = {}  # guarded: key -> (object id, item)
        self._sizes: dict[str, int] = {}  # guarded: key -> framed bytes
        self._bytes = 0  # guarded: bytes of the objects in _objects
        self._evicted_objects = 0  # guarded

    def describe(self) -> dict[str, int]:
        return {"num_shards": self.num_shards, "capacity_bytes": self.capacity_bytes}

    def node_id(self) -> str:
        """The node this shard (and so its objects) lives on."""
        return str(ray.get_runtime_context().get_node_id())

    def put(self, keys: list[str], items: list[Any]) -> list[bool]:
        """Store pages (``items`` alternates framed header bytes and payload arrays);
        whether each key is stored now (False only when the object cannot fit)."""
        with self._lock:
            new = [i for i, key in enumerate(keys) if key not in self._index]
        if not new:
            return [True] * len(keys)
        kept = [x for i in new for x in (items[2 * i], items[2 * i + 1])]
        sizes = [len(kept[2 * j]) + kept[2 * j + 1].nbytes for j in range(len(new))]
        nbytes = sum(sizes)
        if self.capacity_bytes and nbytes > self.capacity_bytes:
            stored = set(range(len(keys))) - set(new)
            return [i in stored for i in range(len(keys))]
        ref = ray.put(kept)  # this actor owns the object: it outlives the writer
        victims = []
        with self._lock:
            oid = next(self._ids)
            obj = _Object(ref, nbytes, [keys[i] for i in new])
            for j, i in enumerate(new):
                if keys[i] in self._index:  # a concurrent writer stored it meanwhile
                    obj.live -= 1
                    continue
                self._index[keys[i]] = (oid, 2 * j)
                self._sizes[keys[i]] = sizes[j]
            if obj.live:
                self._objects[oid] = obj
                self._bytes += nbytes
                while self.capacity_bytes and self._bytes > self.capacity_bytes:
                    victims.append(self._drop_lru())
        del victims  # references go here, outside the lock
        return [True] * len(keys)

    def locate(self, keys: list[str]) -> tuple[list[Any], list[tuple[int, int] | None]]:
        """The objects holding ``keys`` (each reference once) and, per key, (index into
        them, item index) or None when absent; refreshes the recency of those objects."""
        refs: list[Any] = []
        seen: dict[int, int] = {}
        places: list[tuple[int, int] | None] = []
        with self._lock:
            for key in keys:
                where = self._index.get(key)
                if where is None:
                    places.append(None)
                    continue
                oid, item = where
                if oid not in seen:
                    seen[oid] = len(refs)
                    refs.append(self._objects[oid].ref)
                    self._objects.move_to_end(oid)
                places.append((seen[oid], item))
        return refs, places

    def sizes(self, keys: list[str]) -> list[int | None]:
        with self._lock:
            return [self._sizes.get(key) for key in keys]

    def remove(self, keys: list[str]) -> None:
        dropped = []
        with self._lock:
            for key in keys:
                where = self._index.pop(key, None)
                if where is None:
                    continue
                del self._sizes[key]
                obj = self._objects[where[0]]
                obj.live -= 1
                if not obj.live:
                    dropped.append(self._objects.pop(where[0]))
                    self._bytes -= obj.nbytes
        del dropped

    def scan(self) -> list[tuple[str, int, float]]:
        with self._lock:
            return [
                (key, self._sizes[key], self._objects[oid].stored_at)
                for key, (oid, _) in self._index.items()
            ]

    def clear(self) -> None:
        with self._lock:
            dropped = list(self._objects.values())
            self._objects.clear()
            self._index.clear()
            self._sizes.clear()
            self._bytes = 0
        del dropped

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "objects": len(self._objects),
                "keys": len(self._index),
                "bytes": self._bytes,
                "capacity_bytes": self.capacity_bytes,
                "evicted_objects": self._evicted_objects,
            }

    def _drop_lru(self) -> _Object:
        """Evict the least recently used object (caller holds ``_lock``)."""
        oid, obj = self._objects.popitem(last=False)
        self._bytes -= obj.nbytes
        self._evicted_objects += 1
        for key in obj.keys:
            if self._index.get(key, (-1, 0))[0] == oid:
                del self._index[key]
                del self._sizes[key]
        return obj
