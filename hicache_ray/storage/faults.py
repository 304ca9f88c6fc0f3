"""Fault injection between the paged backend and its object store.

Sitting under the verification layer, it acts on real stored bytes, so every store's error
paths can be driven alike: a write that fails (``OSError``, as a full disk or a refused S3
request would), stores a corrupted or truncated object, or is slow; a read or lookup that
fails or is slow, or delivers flipped bytes. Which keys are hit is decided per key, in key
order, by a seeded generator, so a run is reproducible; the store still gets one call per
batch (cut at the first failing key), so a faulty store takes the production I/O path.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Sequence

from hicache_ray.base.storage_config import Fault
from hicache_ray.storage.objects import ObjectStore, PageCheck, ReadOutcome, SizeOutcome
from hicache_ray.storage.page_format import ReadOut, flip_byte

__all__ = ["FaultyObjects", "InjectedFault"]


class InjectedFault(OSError):
    """An I/O failure raised on purpose by :class:`FaultyObjects`."""


class FaultyObjects(ObjectStore):
    """Wraps an object store and applies ``faults`` to its calls (see the module docstring)."""

    def __init__(self, inner: ObjectStore, faults: tuple[Fault, ...], seed: int = 0) -> None:
        self.inner = inner
        self.faults = faults
        self._lock = threading.Lock()
        self._rng = random.Random(seed)  # guarded by _lock
        self._seen = [0] * len(faults)  # guarded by _lock: matching keys per rule
        self._hits = [0] * len(faults)  # guarded by _lock: keys hit per rule
        self.injected: dict[str, int] = {}  # guarded by _lock: "op.kind" -> keys hit

    def _plan(self, op: str, count: int) -> tuple[list[set[str]], int]:
        """The fault kinds hitting each of ``count`` keys, in key order, cut after the
        first ``fail``; and the index of that failing key (``count`` when none fails).
        Delays are slept here, once for the batch."""
        kinds: list[set[str]] = []
        delay = 0.0
        fail_at = count
        with self._lock:
            for i in range(count):
                hit: set[str] = set()
                for r, fault in enumerate(self.faults):
                    if fault.op != op:
                        continue
                    self._seen[r] += 1
                    if self._seen[r] <= fault.skip or (
                        fault.limit and self._hits[r] >= fault.limit
                    ):
                        continue
                    if self._rng.random() < fault.probability:
                        self._hits[r] += 1
                        name = f"{op}.{fault.kind}"
                        self.injected[name] = self.injected.get(name, 0) + 1
                        hit.add(fault.kind)
                        delay += fault.delay_s if fault.kind == "delay" else 0.0
                kinds.append(hit)
                if "fail" in hit:
                    fail_at = i
                    break
        if delay:
            time.sleep(delay)
        return kinds, fail_at

    @staticmethod
    def _failure(op: str) -> InjectedFault:
        return InjectedFault(f"injected {op} failure")

    def size_many(self, keys: Sequence[str], leading: bool = True) -> list[SizeOutcome]:
        _, fail_at = self._plan("size", len(keys))
        out = list(self.inner.size_many(keys[:fail_at], leading)) if fail_at else []
        stopped = len(out) < fail_at or (leading and None in out)
        if fail_at < len(keys) and not stopped and not any(isinstance(o, Exception) for o in out):
            out.append(self._failure("size"))
        return out

    def read_many(
        self, keys: Sequence[str], outs: Sequence[ReadOut], check: PageCheck | None = None
    ) -> list[ReadOutcome]:
        del check  # the pages change after the inner read: the caller verifies them all
        kinds, fail_at = self._plan("read", len(keys))
        found = list(self.inner.read_many(keys[:fail_at], outs[:fail_at])) if fail_at else []
        for i, outcome in enumerate(found):
            if isinstance(outcome, tuple) and "corrupt" in kinds[i] and outs[i].nbytes:
                flip_byte(outs[i])  # as if the medium returned a flipped byte
                found[i] = outcome[0], None  # the caller hashes what it got
        if len(found) == fail_at < len(keys) and all(isinstance(o, tuple) for o in found):
            found.append(self._failure("read"))
        return found

    def write_many(
        self, keys: Sequence[str], headers: Sequence[bytes], payloads: Sequence[memoryview]
    ) -> list[Exception | None]:
        kinds, fail_at = self._plan("write", len(keys))
        damaged = []
        for hit, payload in zip(kinds[:fail_at], payloads[:fail_at], strict=True):
            if "truncate" in hit:
                payload = payload[: payload.nbytes // 2]
            if "corrupt" in hit and payload.nbytes:
                flipped = bytearray(payload)
                flipped[len(flipped) // 2] ^= 0xFF
                payload = memoryview(flipped)
            damaged.append(payload)
        errors = (
            list(self.inner.write_many(keys[:fail_at], headers[:fail_at], damaged))
            if fail_at
            else []
        )
        if len(errors) == fail_at < len(keys) and all(e is None for e in errors):
            errors.append(self._failure("write"))
        return errors

    def remove_many(self, keys: Sequence[str]) -> None:
        _, fail_at = self._plan("remove", len(keys))
        if fail_at:
            self.inner.remove_many(keys[:fail_at])
        if fail_at < len(keys):
            raise self._failure("remove")

    def scan(self) -> Iterator[tuple[str, int, float]]:
        return self.inner.scan()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()
