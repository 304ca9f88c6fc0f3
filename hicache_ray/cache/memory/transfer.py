"""Moves pages between the device pool (L1) and the host pool (L2), layer by layer.

Threading model: the engine owns ``num_workers`` :class:`_CopyWorker` threads, started in
``__init__`` and stopped in :meth:`TransferEngine.close` (idempotent). Each transfer is split
into parts (by slot, then by page range) that the workers copy layer by layer, all workers
taking transfers in submission order, so transfers complete in FIFO order. A transfer's
layer counter is the lowest layer every part has finished; ``wait_until(layer)`` blocks on
it, so a forward pass can start layer *l* as soon as layer *l* is in.

On CPU the copies are numpy slice assignments (they release the GIL, so the workers copy in
parallel); on CUDA they are ``copy_(non_blocking=True)`` on a side stream per worker, and a
layer counts as done once its CUDA event has completed. Runs of consecutive pages on both
sides are copied as one slice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Literal

import torch

from hicache_ray.base.errors import TransferError
from hicache_ray.base.workers import InboxWorker
from hicache_ray.cache.memory.device_pool import DevicePool
from hicache_ray.cache.memory.host_pool import HostPool

__all__ = ["Direction", "Transfer", "TransferEngine", "page_runs"]

Direction = Literal["load", "write"]  # load: host -> device; write: device -> host


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group page pairs into runs consecutive on both sides: ``(src, dst, length)``."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if runs:
            rs, rd, n = runs[-1]
            if s == rs + n and d == rd + n:
                runs[-1] = (rs, rd, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


class Transfer:
    """One batch of page copies in one direction, with a per-layer completion counter.

    Thread-safe: workers report progress, any thread may wait.
    """

    def __init__(
        self,
        direction: Direction,
        host_pages: list[int],
        device_pages: list[int],
        num_layers: int,
        num_parts: int,
        num_bytes: int,
    ) -> None:
        self.direction = direction
        self.host_pages = host_pages
        self.device_pages = device_pages
        self.num_layers = num_layers
        self.num_bytes = num_bytes
        self.submitted_at = time.perf_counter()
        self.finished_at: float | None = None
        self._cond = threading.Condition()
        self._part_layers = [0] * num_parts  # guarded by _cond: layers done per part
        self._layers_done = 0 if num_parts else num_layers  # guarded by _cond
        self._error: BaseException | None = None  # guarded by _cond
        self._parts_running = num_parts  # guarded by _cond
        if not num_parts:
            self.finished_at = self.submitted_at

    @property
    def layers_done(self) -> int:
        with self._cond:
            return self._layers_done

    @property
    def done(self) -> bool:
        """True once every layer is copied or the transfer failed."""
        with self._cond:
            return self._error is not None or self._layers_done >= self.num_layers

    @property
    def ok(self) -> bool:
        with self._cond:
            return self._error is None and self._layers_done >= self.num_layers

    @property
    def settled(self) -> bool:
        """True once no worker will touch this transfer's pages again (even after a failure,
        other parts may still be copying until then)."""
        with self._cond:
            return self._parts_running == 0

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def wait_until(self, layer: int, timeout: float | None = None) -> None:
        """Block until local layer ``layer`` is copied.

        Raises:
            TransferError: the copy failed, or ``timeout`` seconds passed first.
        """
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._error is not None or self._layers_done > layer, timeout
            )
            if self._error is not None:
                raise TransferError(f"{self.direction} transfer failed: {self._error}") from (
                    self._error
                )
            if not ready:
                raise TransferError(
                    f"{self.direction} transfer: layer {layer} not in after {timeout}s"
                )

    def wait(self, timeout: float | None = None) -> None:
        """Block until every layer is copied (see :meth:`wait_until`)."""
        self.wait_until(self.num_layers - 1, timeout)

    def _part_done(self, part: int, layer: int) -> None:
        with self._cond:
            self._part_layers[part] = layer + 1
            done = min(self._part_layers)
            if done != self._layers_done:
                self._layers_done = done
                if done >= self.num_layers:
                    self.finished_at = time.perf_counter()
                self._cond.notify_all()

    def _part_end(self) -> None:
        with self._cond:
            self._parts_running -= 1

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
                self.finished_at = time.perf_counter()
                self._cond.notify_all()


class _Part:
    """The share of one transfer that one worker copies: one slot, a slice of the runs."""

    __slots__ = ("index", "runs", "slot", "transfer")

    def __init__(self, transfer: Transfer, index: int, slot: int, runs: list[tuple[int, int, int]]):
        self.transfer = transfer
        self.index = index
        self.slot = slot
        self.runs = runs


class _CopyWorker(InboxWorker["_Part"]):
    """Copies the parts queued to it, layer by layer, in submission order."""

    def __init__(self, engine: TransferEngine, index: int) -> None:
        super().__init__(f"hicache-copy-{index}")
        self._engine = engine
        self._stream = (
            torch.cuda.Stream()  # type: ignore[no-untyped-call]
            if engine.device.type == "cuda"
            else None
        )

    def handle(self, part: _Part) -> None:
        self._copy(part)

    def failed(self, part: _Part, exc: Exception) -> None:
        part.transfer._fail(exc)

    def finished(self, part: _Part) -> None:
        part.transfer._part_end()

    def _copy(self, part: _Part) -> None:
        engine, t = self._engine, part.transfer
        load = t.direction == "load"
        for layer in range(t.num_layers):
            if self._stream is None:
                dev = engine.device_pool.page_rows_bytes(layer, part.slot)
                host = engine.host_pool.page_rows_bytes(layer, part.slot)
                src, dst = (host, dev) if load else (dev, host)
                for h, d, n in part.runs:
                    i, o = (h, d) if load else (d, h)
                    if n == 1:
                        dst[o] = src[i]
                    else:
                        dst[o : o + n] = src[i : i + n]
            else:
                with torch.cuda.stream(self._stream):
                    dev_t = engine.device_pool.page_rows(layer, part.slot)
                    host_t = engine.host_pool.page_rows(layer, part.slot)
                    for h, d, n in part.runs:
                        if load:
                            dev_t[d : d + n].copy_(host_t[h : h + n], non_blocking=True)
                        else:
                            host_t[h : h + n].copy_(dev_t[d : d + n], non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(self._stream)
                event.synchronize()
            t._part_done(part.index, layer)


class TransferEngine:
    """Asynchronous page copies between one device pool and one host pool."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, num_workers: int = 2) -> None:
        if device_pool.kv != host_pool.kv:
            raise ValueError("device and host pools hold different KV shapes")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device = device_pool.device
        self._lock = threading.Lock()  # guards _workers/_closed against concurrent submit/close
        self._closed = False
        self._workers = [_CopyWorker(self, i) for i in range(max(1, num_workers))]
        for worker in self._workers:
            worker.start()

    def load(self, host_pages: list[int], device_pages: list[int]) -> Transfer:
        """Copy ``host_pages`` into ``device_pages`` (L2 -> L1)."""
        return self._submit("load", host_pages, device_pages)

    def write(self, device_pages: list[int], host_pages: list[int]) -> Transfer:
        """Copy ``device_pages`` into ``host_pages`` (L1 -> L2)."""
        return self._submit("write", host_pages, device_pages)

    def _submit(
        self, direction: Direction, host_pages: list[int], device_pages: list[int]
    ) -> Transfer:
        runs = page_runs(host_pages, device_pages)
        kv = self.device_pool.kv
        split = self._split(runs, kv.kv_slots)
        t = Transfer(
            direction,
            host_pages,
            device_pages,
            kv.num_layers,
            len(split),
            len(host_pages) * kv.page_bytes,
        )
        with self._lock:
            if self._closed:
                raise TransferError("transfer engine is closed")
            for i, (slot, part_runs) in enumerate(split):
                self._workers[i % len(self._workers)].inbox.put(_Part(t, i, slot, part_runs))
        return t

    def _split(
        self, runs: list[tuple[int, int, int]], num_slots: int
    ) -> list[tuple[int, list[tuple[int, int, int]]]]:
        if not runs:
            return []
        chunks = max(1, -(-len(self._workers) // num_slots))
        chunks = min(chunks, len(runs))
        size = -(-len(runs) // chunks)
        pieces = [runs[i : i + size] for i in range(0, len(runs), size)]
        return [(slot, piece) for slot in range(num_slots) for piece in pieces]

    def close(self) -> None:
        """Finish queued copies and stop the workers; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                worker.inbox.put(None)
        for worker in self._workers:
            worker.join()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
