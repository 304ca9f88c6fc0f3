"""Fault injection between a paged backend and its object store.

Sitting under the verification layer, it acts on real stored bytes, so every backend's
error paths can be driven alike: a write that fails (``OSError``, as a full disk or a
refused S3 request would), stores a corrupted or truncated object, or is slow; a read or
lookup that fails or is slow, or delivers flipped bytes. Which calls are hit is decided by
a seeded generator, so a run is reproducible.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

from hicache_ray.config import Fault
from hicache_ray.storage.objects import ObjectStore

__all__ = ["FaultyObjects", "InjectedFault"]


class InjectedFault(OSError):
    """An I/O failure raised on purpose by :class:`FaultyObjects`."""


class FaultyObjects(ObjectStore):
    """Wraps an object store and applies ``faults`` to its calls."""

    parallel_reads = False  # ``skip`` counts calls: they must come in key order

    def __init__(self, inner: ObjectStore, faults: tuple[Fault, ...], seed: int = 0) -> None:
        self.inner = inner
        self.faults = faults
        self._lock = threading.Lock()
        self._rng = random.Random(seed)  # guarded by _lock
        self._seen = [0] * len(faults)  # guarded by _lock: matching calls per rule
        self._hits = [0] * len(faults)  # guarded by _lock: calls hit per rule
        self.injected: dict[str, int] = {}  # guarded by _lock: "op.kind" -> calls hit

    def _fire(self, op: str) -> list[Fault]:
        hits = []
        with self._lock:
            for i, fault in enumerate(self.faults):
                if fault.op != op:
                    continue
                self._seen[i] += 1
                if self._seen[i] <= fault.skip or (fault.limit and self._hits[i] >= fault.limit):
                    continue
                if self._rng.random() < fault.probability:
                    self._hits[i] += 1
                    name = f"{op}.{fault.kind}"
                    self.injected[name] = self.injected.get(name, 0) + 1
                    hits.append(fault)
        for fault in hits:
            if fault.kind == "delay":
                time.sleep(fault.delay_s)
            elif fault.kind == "fail":
                raise InjectedFault(f"injected {op} failure")
        return hits

    def write(self, key: str, header: bytes, payload: memoryview) -> None:
        kinds = {f.kind for f in self._fire("write")}
        if "truncate" in kinds:
            payload = payload[: payload.nbytes // 2]
        if "corrupt" in kinds and payload.nbytes:
            damaged = bytearray(payload)
            damaged[len(damaged) // 2] ^= 0xFF
            payload = memoryview(damaged)
        self.inner.write(key, header, payload)

    def read(self, key: str, out: memoryview) -> tuple[bytes, str | None] | None:
        kinds = {f.kind for f in self._fire("read")}
        found = self.inner.read(key, out)
        if found is not None and "corrupt" in kinds and out.nbytes:
            out[out.nbytes // 2] ^= 0xFF  # as if the medium returned a flipped byte
            return found[0], None  # the caller hashes what it got
        return found

    def size(self, key: str) -> int | None:
        self._fire("size")
        return self.inner.size(key)

    def remove(self, key: str) -> None:
        self._fire("remove")
        self.inner.remove(key)

    def scan(self) -> Iterator[tuple[str, int, float]]:
        return self.inner.scan()

    def close(self) -> None:
        self.inner.close()
