"""The ``ray`` storage backend: verified pages in the Ray object store, shared cluster-wide.

:class:`RayObjects` is the client side of a store made of ``num_shards`` named detached
:class:`~actors.l3_shard.PageShard` actors (``hicache-l3-{name}-{i}`` in the Ray namespace
``hicache``), created by the first user and found by name by every later one, in any job.
A key belongs to shard ``xxh64(key) % num_shards``. Every batch makes one call per shard
involved, all shards at once: ``size_many`` asks ``sizes``; ``write_many`` puts each
shard's pages into objects of about ``object_bytes`` (one copy, owned by the writer for a
moment) and hands the shard their references (the shard serves them at once and copies
them into objects it owns in the background: ``flush`` waits for that); ``read_many``
asks ``locate`` for object references (unless a prefetch query's ``find`` just gave them:
:mod:`actors.located`), fetches the objects (zero-copy on the same node; Ray moves them
across nodes) and copies each payload into the caller's buffer while hashing it, on
``COPY_THREADS`` threads for large pages and on one for pages under ``SPLIT_PAGE_BYTES``.

Failures are misses: a shard that does not answer within ``timeout_s`` or died fails its
keys (the batch stops there; a restarted shard comes back empty); an object that is lost
or whose owner died reads as absent and its keys are dropped from the index.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import wait as futures_wait
from typing import Any

import ray
import xxhash
from ray.exceptions import ActorUnavailableError, RayActorError, RayError

from actors.located import Located
from actors.page_objects import COPY_THREADS, ReadBatch, fetch_objects, group_pages, object_items
from actors.shards import (
    candidate_nodes,
    check_shard_count,
    existing_shards,
    is_dropped,
    mark_dropped,
    shard_handle,
    spread_answer,
)
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.base.workers import started_pool
from hicache_ray.keys import ShardPlan
from hicache_ray.storage import StorageBackend
from hicache_ray.storage.objects import ObjectStore, PageCheck, ReadOutcome, SizeOutcome
from hicache_ray.storage.page_format import (
    ReadOut,
)
from hicache_ray.storage.paged import PagedBackend
from hicache_ray.storage.registry import with_faults

__all__ = ["RayObjects", "ray_backend"]

log = logging.getLogger(__name__)

_RETRY_S = 0.05  # a restarting shard is asked again this often (control calls only)


class _ShardError(OSError):
    """A shard call failed; ``restarting`` when Ray is bringing the shard back."""

    restarting = False


class RayObjects(ObjectStore):
    """Client of the shard actors of store ``options.name`` (see the module docstring)."""

    reads_in_parallel = True  # payloads are copied on COPY_THREADS threads

    # NOTE: measured on 2 cores: a 32 MiB ``ray.put`` took 5 ms alone and 300 ms beside a
    # thread running Python (it takes the GIL back many times and waits for it each time),
    # so headers hashed ahead on the hasher thread cost writes more than they hide.
    hash_ahead = False

    def __init__(self, options: RayStorageOptions) -> None:
        if not ray.is_initialized() and options.address:
            log.info("hicache-ray: connecting to the Ray cluster at %s", options.address)
            ray.init(address=options.address, log_to_driver=False)
        if not ray.is_initialized():
            raise ConfigError(
                "storage_backend",
                "ray",
                "Ray is not initialized in this process",
                "call ray.init() first, run inside a Ray actor or job, or set ray.address",
            )
        self.options = options
        self._lock = threading.Lock()
        mark_dropped(options.name, False)  # opening a store (again) makes it
        existing = existing_shards(options.name, options.timeout_s)
        check_shard_count(options.name, options.num_shards, existing)
        # 0: join the store's own count, or make one shard per node that can hold one
        self.num_shards = options.num_shards or existing or max(1, len(candidate_nodes(options)))
        self._shards = [shard_handle(options, i, self.num_shards) for i in range(self.num_shards)]
        self._copiers = started_pool(COPY_THREADS, "hicache-ray-copy")
        self._located = Located()  # where leading lookups found their keys, for reads
        # NOTE: a store that is slow to start (new shard processes on a loaded machine) or
        # restarting is not an error to whoever opens it: its batches are misses until
        # shard 0 has answered and confirmed the shard count (``_check_ready``).
        self._verified = existing is not None  # guarded by _lock
        self._mismatch: ConfigError | None = None  # guarded by _lock
        # guarded by _lock: shard 0's pending answer (None once verified at opening)
        self._describe: Any = None if self._verified else self._remote(0, "describe")
        if not self._verified:
            with self._lock:
                ref = self._describe
            if not isinstance(ref, Exception):
                ray.wait([ref], timeout=options.timeout_s)
            try:
                self._check_ready()  # a shard-count mismatch raises ConfigError
            except OSError as exc:
                log.warning("store %s: %s (misses until it answers)", options.name, exc)

    def _check_ready(self) -> None:
        """Return once shard 0 has confirmed the shard count; raise ``_ShardError`` (a
        miss for the batch) while it has not answered, ``ConfigError`` on a mismatch found
        while opening (later: a ``_ShardError`` naming it, never an error to the caller)."""
        with self._lock:
            if self._verified:
                return
            if self._mismatch is not None:
                raise _ShardError(str(self._mismatch))
            ref = self._describe
        if not isinstance(ref, Exception) and not ray.wait([ref], timeout=0)[0]:
            raise _ShardError(f"store {self.options.name!r} is starting: shard 0 has not answered")
        answer = self._wait(0, ref)
        with self._lock:
            if isinstance(answer, Exception):
                self._describe = self._remote(0, "describe")  # ask again for the next batch
                raise answer
            try:
                check_shard_count(self.options.name, self.num_shards, answer["num_shards"])
            except ConfigError as exc:
                self._mismatch = exc
                log.error("store %s: %s", self.options.name, exc)
                raise
            self._verified = True

    def _ready_or_miss(self) -> None:
        try:
            self._check_ready()
        except ConfigError as exc:
            raise _ShardError(str(exc)) from exc

    # ------------------------------------------------------------- batches

    def size_many(self, keys: Sequence[str], leading: bool = True) -> list[SizeOutcome]:
        """A leading lookup is a prefetch query: the shards also say where each object is
        (``find``), and a read of those keys soon after asks no shard (:class:`Located`)."""
        self._ready_or_miss()
        out: list[SizeOutcome] = [None] * len(keys)
        with self._lock:  # shards an older version made (detached, still running) lack it
            leading_find = leading and all(hasattr(h, "find") for h in self._shards)
        for idx, answer in self._fan_out(keys, "find" if leading_find else "sizes"):
            if leading_find and not isinstance(answer, Exception):
                refs, places, answer = answer
                self._located.remember([keys[i] for i in idx], refs, places, answer)
            for i, value in zip(idx, spread_answer(answer, len(idx)), strict=True):
                out[i] = value
        # Every shard answered at once; the batch still ends at its first failure (and, for
        # leading lookups, its first absent key).
        for i, value in enumerate(out):
            if isinstance(value, Exception) or (leading and value is None):
                return out[: i + 1]
        return out

    def write_many(
        self, keys: Sequence[str], headers: Sequence[bytes], payloads: Sequence[memoryview]
    ) -> list[Exception | None]:
        return self.write_owned(keys, headers, payloads, "")

    def write_owned(
        self,
        keys: Sequence[str],
        headers: Sequence[bytes],
        payloads: Sequence[memoryview],
        owner: str,
    ) -> list[Exception | None]:
        """Each object holds one owner's pages (a put is one owner's): the shard counts it
        against that owner's quota (:meth:`PageShard.set_quotas`)."""
        self._ready_or_miss()
        errors: list[Exception | None] = [None] * len(keys)
        chunks = [
            (shard, chunk)
            for shard, idx in self._by_shard(keys).items()
            for chunk in group_pages(idx, payloads, self.options.object_bytes)
        ]
        calls = []
        for shard, idx in chunks:
            items = object_items(idx, headers, payloads)
            # NOTE: one copy here, into an object this process owns; the shard serves it at
            # once and makes its own copy in the background (see ``l3_shard``), so a put
            # costs the writer one copy, not two.
            sizes = [len(headers[i]) + payloads[i].nbytes for i in idx]
            try:
                holder = [ray.put(items)]
            except RayError as exc:
                calls.append((shard, idx, exc))
                continue
            put_keys = [keys[i] for i in idx]
            calls.append((shard, idx, self._remote(shard, "put", put_keys, sizes, holder, owner)))
        for shard, idx, ref in calls:
            answer = self._wait(shard, ref)
            for i, ok in zip(idx, spread_answer(answer, len(idx)), strict=True):
                if isinstance(ok, Exception):
                    errors[i] = ok
                elif not ok:
                    errors[i] = OSError(f"store {self.options.name!r} shard {shard} is full")
        for i, error in enumerate(errors):
            if error is not None:  # the batch ends there (later keys may be stored anyway)
                return errors[: i + 1]
        return errors

    def read_many(
        self, keys: Sequence[str], outs: Sequence[ReadOut], check: PageCheck | None = None
    ) -> list[ReadOutcome]:
        # NOTE: each shard's pages are fetched and copied (and checked) as soon as its
        # answer arrives, in one job per copy thread (a future per page cost more than its
        # copy), the last answer's first job on this thread. Copies may so run past an
        # absent key; all are waited for before returning.
        self._ready_or_miss()
        batch, answered = ReadBatch(keys, outs, check), 0
        try:
            for idx, answer, recalled in self._places(keys):
                answered += len(idx)  # each key is in one answer
                if isinstance(answer, Exception):
                    batch.fail(idx, answer)
                    continue
                refs, found = answer
                last = answered == len(keys)
                batch.copy(self._copiers, idx, self._fetch(refs), found, recalled, here=last)
            for job in batch.jobs:
                job.result()
            return batch.outcomes()
        finally:
            futures_wait(batch.jobs)  # no copy may still write into the caller's buffers
            if batch.lost:
                self.remove_many(batch.lost)  # their objects are gone: drop them from the index

    def remove_many(self, keys: Sequence[str]) -> None:
        self._located.forget(keys)
        for _ in self._fan_out(keys, "remove"):
            pass

    def _places(self, keys: Sequence[str]) -> Iterator[tuple[list[int], Any, bool]]:
        """``locate``'s answers for ``keys`` (key indices, answer, recalled): first one for
        the keys a recent leading lookup found (no shard asked), then each shard's for the
        rest."""
        known, answer = self._located.take(keys)
        if known:
            yield known, answer, True
        taken = set(known)
        rest = [i for i in range(len(keys)) if i not in taken]
        for idx, found in self._fan_out([keys[i] for i in rest], "locate"):
            yield [rest[j] for j in idx], found, False

    def shard_handle(self, shard: int) -> Any:
        """The actor handle of shard ``shard`` (benchmarks time one round trip with it)."""
        with self._lock:
            return self._shards[shard]

    def flush(self) -> None:
        """Wait until every shard owns the objects written to it so far (they then outlive
        their writers); a shard that does not answer is skipped."""
        for shard in range(len(self._shards)):
            try:
                self.call(shard, "settle", self.options.timeout_s)
            except OSError as exc:
                log.warning("store %s: settling shard %d failed: %s", self.options.name, shard, exc)

    def scan(self) -> Iterator[tuple[str, int, float]]:
        for shard in range(len(self._shards)):
            try:
                yield from self.call(shard, "scan")
            except OSError as exc:
                log.warning("store %s: scanning shard %d failed: %s", self.options.name, shard, exc)

    def close(self) -> None:
        self._copiers.shutdown(wait=True)

    # ----------------------------------------------------------- plumbing

    def _by_shard(self, keys: Sequence[str]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        n = len(self._shards)
        for i, key in enumerate(keys):
            groups.setdefault(xxhash.xxh64_intdigest(key.encode()) % n, []).append(i)
        return groups

    def _fan_out(self, keys: Sequence[str], method: str) -> Iterator[tuple[list[int], Any]]:
        """One call of ``method`` per shard with its keys, all in flight at once; yields
        each shard's key indices and its answer (or an ``OSError`` when it failed), in
        the order the answers arrive."""
        calls: dict[Any, tuple[int, list[int]]] = {}
        for shard, idx in self._by_shard(keys).items():
            ref = self._remote(shard, method, [keys[i] for i in idx])
            if isinstance(ref, Exception):
                yield idx, self._failed(shard, ref)
            else:
                calls[ref] = (shard, idx)
        deadline = time.monotonic() + self.options.timeout_s
        while calls:
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(calls), num_returns=1, timeout=left)
            if not ready:  # past the deadline: every shard still out has failed
                for shard, idx in calls.values():
                    timeout = TimeoutError(f"no answer within {self.options.timeout_s:g}s")
                    yield idx, self._failed(shard, timeout)
                return
            shard, idx = calls.pop(ready[0])
            yield idx, self._wait(shard, ready[0])

    def _remote(self, shard: int, method: str, *args: Any) -> Any:
        with self._lock:
            handle = self._shards[shard]
        try:
            return getattr(handle, method).remote(*args)
        except RayError as exc:
            return exc

    def _wait(self, shard: int, ref: Any) -> Any:
        if isinstance(ref, Exception):
            return self._failed(shard, ref)
        try:
            return ray.get(ref, timeout=self.options.timeout_s)
        except RayError as exc:  # includes GetTimeoutError
            return self._failed(shard, exc)

    def _failed(self, shard: int, exc: Exception) -> OSError:
        restarting = isinstance(exc, ActorUnavailableError)
        if isinstance(exc, RayActorError) and not restarting and not is_dropped(self.options.name):
            with self._lock:  # gone for good: find or make it again (unless dropped)
                self._shards[shard] = shard_handle(self.options, shard, self.num_shards)
        failure = _ShardError(
            f"store {self.options.name!r} shard {shard}: {type(exc).__name__}: {exc}"
        )
        failure.restarting = restarting
        return failure

    def call(self, shard: int, method: str, *args: Any) -> Any:
        """One call that must go through (describe, scan, clear, stats): a shard that is
        restarting is asked again until ``timeout_s``."""
        deadline = time.monotonic() + self.options.timeout_s
        while True:
            answer = self._wait(shard, self._remote(shard, method, *args))
            if not isinstance(answer, Exception):
                return answer
            if not getattr(answer, "restarting", False) or time.monotonic() > deadline:
                raise answer
            time.sleep(_RETRY_S)

    def _fetch(self, refs: list[Any]) -> list[list[Any] | None]:
        return fetch_objects(refs, self.options.timeout_s, self.options.name)


def ray_backend(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    """The ``ray`` backend (named by path in :mod:`hicache_ray.base.backends`)."""
    # No byte budget here: the shards evict on their own (capacity_bytes per shard).
    objects = with_faults(config, RayObjects(config.ray))
    return PagedBackend(
        "ray", objects, plan, metadata_ttl_s=config.ray.metadata_ttl_s, scan_on_start=False
    )
