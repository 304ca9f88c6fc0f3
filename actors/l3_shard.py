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
by ``locate`` refresh an object's recency. A put names its pages' owner (a tenant, or
``""``); an owner with a quota (:meth:`PageShard.set_quotas`) keeps at most that many
bytes here: its own least recently used objects go first. Methods run on several actor
threads at once;
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
    __slots__ = ("keys", "live", "nbytes", "owned", "owner", "ref", "stored_at")

    def __init__(self, ref: Any, nbytes: int, keys: list[str], owner: str) -> None:
        self.ref = ref
        self.owner = owner  # the tenant whose quota it counts against ("": none)
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
        self._owner_bytes: dict[str, int] = {}  # guarded: the same, per owner
        self._quotas: dict[str, int] = {}  # guarded: owner -> most bytes here
        self._quota_evicted = 0  # guarded
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

    def put(
        self, keys: list[str], sizes: list[int], holder: list[Any], owner: str = ""
    ) -> list[bool]:
        """Index the pages of the writer's object ``holder[0]`` (a list alternating each
        key's framed header and payload; ``sizes`` their framed bytes), pages of ``owner``;
        whether each key is stored now (False only when the object cannot fit the budget or
        its owner's quota). Adopted in the background."""
        ref = holder[0]
        nbytes = sum(sizes)
        victims = []
        with self._lock:
            if all(key in self._index for key in keys):
                return [True] * len(keys)
            quota = self._quotas.get(owner, 0)
            if nbytes > (self.capacity_bytes or nbytes) or nbytes > (quota or nbytes):
                return [key in self._index for key in keys]  # it can never fit
            oid = next(self._ids)
            obj = _Object(ref, nbytes, list(keys), owner)
            for i, key in enumerate(keys):
                if key in self._index:  # stored already (by this or a concurrent writer)
                    obj.live -= 1
                    continue
                self._index[key] = (oid, 2 * i)
                self._sizes[key] = sizes[i]
            self._objects[oid] = obj
            self._bytes += nbytes
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + nbytes
            victims += self._over_quota(owner)
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

    def find(
        self, keys: list[str]
    ) -> tuple[list[Any], list[tuple[int, int] | None], list[int | None]]:
        """:meth:`locate` and :meth:`sizes` in one call: a prefetch query, whose reads
        then need no ``locate`` of their own."""
        refs, places = self.locate(keys)
        with self._lock:
            return refs, places, [self._sizes.get(key) for key in keys]

    def sizes(self, keys: list[str]) -> list[int | None]:
        with self._lock:
            return [self._sizes.get(key) for key in keys]

    def _num_pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def set_quotas(self, quotas: dict[str, int]) -> None:
        """Owner -> the most bytes of its objects this shard keeps (0 or absent: no quota);
        replaces the table, and an owner over its new quota loses its least recently used
        objects at once."""
        with self._lock:
            self._quotas = {o: int(q) for o, q in quotas.items() if q > 0}
            victims = [v for owner in list(self._owner_bytes) for v in self._over_quota(owner)]
        del victims

    def owners(self) -> dict[str, int]:
        """Bytes held per owner (``""``: pages of no tenant)."""
        with self._lock:
            return dict(self._owner_bytes)

    def quotas(self) -> dict[str, int]:
        """The quotas in force here, by owner."""
        with self._lock:
            return dict(self._quotas)

    def _over_quota(self, owner: str) -> list[_Object]:
        """Evict ``owner``'s least recently used objects until it is within its quota
        (caller holds ``_lock``); the victims, to release outside it."""
        quota, victims = self._quotas.get(owner, 0), []
        if quota and self._owner_bytes.get(owner, 0) > quota:
            for oid in [oid for oid, obj in self._objects.items() if obj.owner == owner]:
                victims.append(self._forget_object(oid))
                self._quota_evicted += 1
                if self._owner_bytes.get(owner, 0) <= quota:
                    break
        return victims

    def _forget_object(self, oid: int) -> _Object:
        """Drop object ``oid`` and every key indexed to it (caller holds ``_lock``)."""
        obj = self._objects.pop(oid)
        self._bytes -= obj.nbytes
        self._drop_owner_bytes(obj)
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
                    self._drop_owner_bytes(obj)
        del dropped

    def _drop_owner_bytes(self, obj: _Object) -> None:
        left = self._owner_bytes.get(obj.owner, 0) - obj.nbytes
        if left > 0:
            self._owner_bytes[obj.owner] = left
        else:
            self._owner_bytes.pop(obj.owner, None)

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
            self._owner_bytes.clear()
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
                quota_evicted_objects=self._quota_evicted,
                lost_objects=self._lost_objects,
                adopting=self._num_pending(),
            )

    def _drop_lru(self) -> _Object:
        """Evict the least recently used object (caller holds ``_lock``)."""
        oid = next(iter(self._objects))
        self._evicted_objects += 1
        return self._forget_object(oid)
