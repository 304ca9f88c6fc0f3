"""How the ``ray`` store lays pages out in Ray objects: the pages of one put, grouped per
shard into objects of about ``object_bytes``, each a list alternating a page's framed
header (bytes) and its payload (a uint8 array); and reading one page back out of them."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayError

from hicache_ray.storage.objects import PageCheck, ReadOutcome
from hicache_ray.storage.page_format import (
    PREFIX_BYTES,
    CorruptPage,
    ReadOut,
    copy_hashed,
    header_length,
)

__all__ = [
    "COPY_THREADS",
    "SPLIT_PAGE_BYTES",
    "ReadBatch",
    "copy_item",
    "copy_items",
    "copy_shares",
    "fetch_objects",
    "group_pages",
    "object_items",
    "start_copies",
]

log = logging.getLogger(__name__)

# A read spreads its pages over the copy threads only when they are at least this large.
# A smaller page's copy is short beside its Python work (slicing, the header, the checksum
# call, the check), which holds the GIL: more threads only queue for it. 32 MiB of pages
# copied and hashed on a pool's threads, 2 cores: 64 KiB pages 4.5 ms on one thread, 5.9
# on two, 6.1-7.2 on three; 1 MiB pages 3.3 on one, 2.1-3.2 on two or three.
SPLIT_PAGE_BYTES = 512 << 10
# Payload copies (and checksums) of one read run on up to this many threads (pages of at
# least SPLIT_PAGE_BYTES; smaller ones on one): copies are bound by memory bandwidth,
# checksums by the CPU.
COPY_THREADS = 3


_Item = tuple[int, list[Any], int, ReadOut]  # key index, object, item in it, destination


def group_pages(
    idx: list[int], payloads: Sequence[memoryview], object_bytes: int
) -> Iterator[list[int]]:
    """The pages ``idx`` (in order) in groups of at most ~``object_bytes`` of payload (a page
    larger than that is a group alone)."""
    chunk: list[int] = []
    size = 0
    for i in idx:
        if chunk and size + payloads[i].nbytes > object_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(i)
        size += payloads[i].nbytes
    yield chunk


def object_items(
    idx: list[int], headers: Sequence[bytes], payloads: Sequence[memoryview]
) -> list[Any]:
    """The contents of one object holding the pages ``idx``."""
    items: list[Any] = []
    for i in idx:
        items += [headers[i], np.frombuffer(payloads[i], dtype=np.uint8)]
    return items


def copy_shares(todo: list[_Item], threads: int) -> list[list[_Item]]:
    """``todo``'s pages (all of one size) as the jobs of a read: one per copy thread for
    pages of at least ``SPLIT_PAGE_BYTES``, a single job for smaller ones."""
    parts = threads if todo and todo[0][3].nbytes >= SPLIT_PAGE_BYTES else 1
    return [share for part in range(parts) if (share := todo[part::parts])]


class ReadBatch:
    """One read's state as the shards' answers arrive (``RayObjects.read_many``): each
    key's standing (``where``: True once copying, None if absent, or the failure), the
    copies started and the keys whose objects are lost."""

    def __init__(
        self, keys: Sequence[str], outs: Sequence[ReadOut], check: PageCheck | None
    ) -> None:
        self.keys, self.outs, self.check = keys, outs, check
        self.where: list[Any] = [None] * len(keys)
        self.gap = len(keys)  # lowest key known not to be readable: none past it is copied
        self.copied: dict[int, ReadOutcome] = {}
        self.jobs: list[Future[None]] = []
        self.lost: list[str] = []

    def fail(self, idx: list[int], failure: Exception) -> None:
        """Keys ``idx`` (one shard's) failed with ``failure``."""
        for i in idx:
            self.where[i] = failure
        self.gap = min(self.gap, idx[0])

    def copy(
        self,
        pool: Executor,
        idx: list[int],
        objects: list[list[Any] | None],
        found: Sequence[tuple[int, int] | None],
        recalled: bool,
        *,
        here: bool,
    ) -> None:
        """Start copying keys ``idx`` out of ``objects`` (``found``: each key's object and
        item, None if absent; ``recalled``: from a recent lookup, not the shard's answer
        now) on ``pool``, the first job on this thread if ``here`` (:func:`start_copies`)."""
        todo = []
        for i, place in zip(idx, found, strict=True):
            obj = None if place is None else objects[place[0]]
            if place is None or obj is None:  # absent; or lost, or its owner died: a miss
                # (a recalled reference may be a writer's the shard has adopted since:
                # only a shard's own answer drops a key)
                if place is not None and not recalled:
                    self.lost.append(self.keys[i])
                self.gap = min(self.gap, i)
            elif i < self.gap:
                self.where[i] = True
                todo.append((i, obj, place[1], self.outs[i]))
        self.jobs += start_copies(pool, todo, self.copied, self.check, here=here)

    def outcomes(self) -> list[ReadOutcome]:
        """Each key's outcome up to the first that ends the batch (its copies done)."""
        outcomes: list[ReadOutcome] = []
        for i in range(len(self.keys)):
            if self.where[i] is not True:
                outcomes.append(self.where[i])  # the key that ends the batch
                break
            outcomes.append(self.copied[i])
        return outcomes


def start_copies(
    pool: Executor,
    todo: list[_Item],
    into: dict[int, ReadOutcome],
    check: PageCheck | None,
    *,
    here: bool,
) -> list[Future[None]]:
    """``todo``'s copies as jobs of ``pool`` (:func:`copy_shares`); with ``here`` (a read's
    last), the first job runs on this thread, once the others are submitted (handing it
    to a copy thread cost 0.4-3.7 ms of a TP=2 L3 hit on 2 cores). The jobs submitted."""
    shares = copy_shares(todo, COPY_THREADS)
    first = shares.pop(0) if shares and here else None
    jobs = [pool.submit(copy_items, share, into, check) for share in shares]
    if first is not None:
        try:
            copy_items(first, into, check)
        except BaseException:
            futures_wait(jobs)  # none may still write into the caller's buffers
            raise
    return jobs


def copy_items(
    todo: list[_Item],
    into: dict[int, ReadOutcome],
    check: PageCheck | None = None,
) -> None:
    """On a copy thread: each page's outcome into ``into`` (a dict: one writer per key),
    verified by ``check`` right after its copy (:meth:`ObjectStore.read_many`)."""
    for i, obj, item, out in todo:
        outcome = copy_item(obj, item, out)
        if check is not None and isinstance(outcome, tuple) and outcome[1] is not None:
            try:
                check(i, outcome[0], outcome[1])
            except CorruptPage as exc:
                outcome = exc
        into[i] = outcome


def copy_item(obj: list[Any], item: int, out: ReadOut) -> ReadOutcome:
    """Header body and payload checksum of one stored page, its payload copied into ``out``."""
    framed, payload = obj[item], _bytes_of(obj[item + 1])
    try:
        start = PREFIX_BYTES + header_length(framed)
        if payload.nbytes != out.nbytes:
            raise CorruptPage(f"payload of {payload.nbytes} bytes, expected {out.nbytes}")
    except CorruptPage as exc:
        return exc
    return bytes(framed[PREFIX_BYTES:start]), copy_hashed(payload, out)


def _bytes_of(payload: Any) -> np.ndarray | memoryview:
    """A stored payload as it is copied: the byte array this module writes, as is (a
    memoryview of it and numpy's ``frombuffer`` of that cost a TP=2 rank's 512 objects
    about 0.7 ms, in one warm process), or else a memoryview of whatever the object holds."""
    if (
        type(payload) is np.ndarray
        and payload.dtype == np.uint8
        and payload.ndim == 1
        and payload.flags.c_contiguous
    ):
        return payload
    return memoryview(payload)


def fetch_objects(refs: list[Any], timeout_s: float, store: str) -> list[list[Any] | None]:
    """The object of each of ``refs``, in order (zero-copy from the same node's store);
    None for a lost one (or one whose owner died)."""
    ids = [ref.hex() for ref in refs]
    unique = dict(zip(ids, refs, strict=True))  # by id, each object once
    if not unique:
        return []
    found: dict[str, list[Any]] = {}
    try:
        values = ray.get(list(unique.values()), timeout=timeout_s)
        found = dict(zip(unique, values, strict=True))
    except RayError:
        for oid, ref in unique.items():  # one by one, to tell the lost ones from the rest
            try:
                found[oid] = ray.get(ref, timeout=timeout_s)
            except RayError as exc:
                log.info("store %s: object %s is gone (%s)", store, oid, exc)
    return [found.get(i) for i in ids]
