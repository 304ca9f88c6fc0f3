"""One index shard of the object-store L3: it owns page objects and maps keys to them.

Pages must outlive the rank and the deployment that wrote them, and a Ray object lives as
long as its owner (the process that put it). So the shard, a named detached actor, owns
every object of its keys: a writer puts its pages into an object of its own (one copy) and
hands the shard a reference; the shard indexes and serves it at once, and copies it into an
object it owns itself on its copy thread (``_adopt``), then lets the writer's go. Until
then the page is as durable as its writer: a writer that dies first takes those pages with
it, and they read as misses (``settle`` waits for the shard's copies). Pages of one put
arrive together and become one object (a list alternating each page's framed header and
its payload array), so an object holds several MiB, not one page: a Ray object per page
would cost about 0.6 ms per put here.

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
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import ray

from actors.stats import ShardStats

__all__ = ["PageShard"]

_ADOPT_TIMEOUT_S = 60.0  # a writer's object that cannot be fetched by then is lost


class _Object:
    __slots__ = ("keys", "live", "nbytes", "owned", "ref", "stored_at")

    def __init__(self, ref: Any, nbytes: int, keys: list[str]) -> None:
        self.ref = ref
        self.nbytes = nbytes
        self.keys = keys  # item 2 * i holds keys[i]'s header, 2 * i + 1 its payload
        self.live = len(keys)  # keys still indexed to this object
        self.stored_at = time.time()
        self.owned = False  # the shard's own copy (else the writer's, until adopted)


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
        self._lost_objects = 0  # guarded: writers' objects lost before they were adopted
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-adopt")
        self._pending_lock = threading.Lock()
        self._pending: set[Future[None]] = set()  # guarded by _pending_lock: adoptions running

    def describe(self) -> dict[str, int]:
        return {"num_shards": self.num_shards, "capacity_bytes": self.capacity_bytes}

    def node_id(self) -> str:
        """The node this shard (and so its objects) lives on."""
        return str(ray.get_runtime_context().get_node_id())

    def put(self, keys: list[str], sizes: list[int], holder: list[Any]) -> list[bool]:
        """Index the pages of the writer's object ``holder[0]`` (a list alternating each
        key's framed header and payload; ``sizes`` their framed bytes); whether each key is
        stored now (False only when the object cannot fit). Adopted in the background."""
        ref = holder[0]
        nbytes = sum(sizes)
        victims = []
        with self._lock:
            if all(key in self._index for key in keys):
                return [True] * len(keys)
            if self.capacity_bytes and nbytes > self.capacity_bytes:
                return [key in self._index for key in keys]
            oid = next(self._ids)
            obj = _Object(ref, nbytes, list(keys))
            for i, key in enumerate(keys):
                if key in self._index:  # stored already (by this or a concurrent writer)
                    obj.live -= 1
                    continue
                self._index[key] = (oid, 2 * i)
                self._sizes[key] = sizes[i]
            self._objects[oid] = obj
            self._bytes += nbytes
            while self.capacity_bytes and self._bytes > self.capacity_bytes:
                victims.append(self._drop_lru())
            adopt = oid in self._objects
        del victims  # references go here, outside the lock
        if adopt:
            job = self._copier.submit(self._adopt, oid, ref)
            with self._pending_lock:
                self._pending.add(job)
            job.add_done_callback(self._adopted)
        return [True] * len(keys)

    def _adopted(self, job: Future[None]) -> None:
        with self._pending_lock:
            self._pending.discard(job)

    def _adopt(self, oid: int, borrowed: Any) -> None:
        """On the copy thread: make object ``oid`` this shard's own (a copy it ``ray.put``s),
        releasing the writer's; a writer's object already lost takes its keys with it."""
        try:
            own = ray.put(ray.get(borrowed, timeout=_ADOPT_TIMEOUT_S))
        except Exception:  # the writer died first (or its node did): its pages are misses
            with self._lock:
                if oid in self._objects:
                    self._lost_objects += 1
                    self._forget_object(oid)
            return
        with self._lock:
            obj = self._objects.get(oid)
            if obj is not None and obj.ref is borrowed:
                obj.ref, obj.owned = own, True

    def settle(self, timeout_s: float = 60.0) -> int:
        """Wait until every object written so far is this shard's own; returns how many
        were still being adopted."""
        with self._pending_lock:
            pending = list(self._pending)
        futures_wait(pending, timeout=timeout_s)
        return len(pending)

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

    def _num_pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def _forget_object(self, oid: int) -> _Object:
        """Drop object ``oid`` and every key indexed to it (caller holds ``_lock``)."""
        obj = self._objects.pop(oid)
        self._bytes -= obj.nbytes
        for key in obj.keys:
            if self._index.get(key, (-1, 0))[0] == oid:
                del self._index[key]
                del self._sizes[key]
        return obj

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

    def stats(self) -> ShardStats:
        with self._lock:
            return ShardStats(
                objects=len(self._objects),
                keys=len(self._index),
                bytes=self._bytes,
                capacity_bytes=self.capacity_bytes,
                evicted_objects=self._evicted_objects,
                lost_objects=self._lost_objects,
                adopting=self._num_pending(),
            )

    def _drop_lru(self) -> _Object:
        """Evict the least recently used object (caller holds ``_lock``)."""
        oid = next(iter(self._objects))
        self._evicted_objects += 1
        return self._forget_object(oid)
