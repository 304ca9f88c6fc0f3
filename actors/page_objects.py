"""How the ``ray`` store lays pages out in Ray objects: the pages of one put, grouped per
shard into objects of about ``object_bytes``, each a list alternating a page's framed
header (bytes) and its payload (a uint8 array); and reading one page back out of them."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
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
    "SPLIT_PAGE_BYTES",
    "copy_item",
    "copy_items",
    "copy_shares",
    "fetch_objects",
    "group_pages",
    "object_items",
]

log = logging.getLogger(__name__)

# A read spreads its pages over the copy threads only when they are at least this large.
# A smaller page's copy is short beside its Python work (slicing, the header, the checksum
# call, the check), which holds the GIL: more threads only queue for it. 32 MiB of pages
# copied and hashed on a pool's threads, 2 cores: 64 KiB pages 4.5 ms on one thread, 5.9
# on two, 6.1-7.2 on three; 1 MiB pages 3.3 on one, 2.1-3.2 on two or three.
SPLIT_PAGE_BYTES = 512 << 10


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
    framed, payload = obj[item], obj[item + 1]
    try:
        start = PREFIX_BYTES + header_length(framed[:PREFIX_BYTES])
        if payload.nbytes != out.nbytes:
            raise CorruptPage(f"payload of {payload.nbytes} bytes, expected {out.nbytes}")
    except CorruptPage as exc:
        return exc
    return bytes(framed[PREFIX_BYTES:start]), copy_hashed(memoryview(payload), out)


def fetch_objects(refs: list[Any], timeout_s: float, store: str) -> dict[str, list[Any]]:
    """The objects of ``refs`` by id (zero-copy from the same node's store); a lost one
    (or one whose owner died) is left out."""
    unique = list({ref.hex(): ref for ref in refs}.values())
    if not unique:
        return {}
    try:
        values = ray.get(unique, timeout=timeout_s)
        return {ref.hex(): v for ref, v in zip(unique, values, strict=True)}
    except RayError:
        pass
    found = {}
    for ref in unique:  # one by one, to tell the lost ones from the rest
        try:
            found[ref.hex()] = ray.get(ref, timeout=timeout_s)
        except RayError as exc:
            log.info("store %s: object %s is gone (%s)", store, ref.hex(), exc)
    return found
