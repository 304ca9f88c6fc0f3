"""Loads of a request's cached host pages into device pages: :class:`HiCache`'s half that
fills the device pages of a hit from L2 (a mixin: it works on the cache's tree, pools,
transfers and counters)."""

from __future__ import annotations

import contextlib

from hicache_ray.base.errors import TransferError
from hicache_ray.base.stats import CacheStats
from hicache_ray.cache.handle import CacheHandle
from hicache_ray.cache.memory import DevicePool, HostPool, Transfer, TransferEngine
from hicache_ray.cache.tree import HiRadixTree, TreeNode

__all__ = ["HostLoads"]


class HostLoads:
    """Starting, waiting for and undoing the L2 -> L1 loads of a request's cached prefix."""

    page_size: int
    tree: HiRadixTree
    transfers: TransferEngine
    device_pool: DevicePool
    host_pool: HostPool
    counters: CacheStats
    _num_private_pages: int

    def _alloc_device(self, num_pages: int) -> list[int] | None:
        raise NotImplementedError  # the cache's own (it evicts)

    def wait_ready(self, handle: CacheHandle, timeout: float | None = None) -> None:
        """Wait for the loads of ``handle``; on a failed load, shorten its cached prefix."""
        for t in handle.loads:
            try:
                t.wait(timeout)
            except TransferError:
                self.counters.load_failures += 1
                self._drop_failed_load(handle, t)
                return
            self.counters.load_latency_s += t.latency_s or 0.0
            self.counters.loads += 1
        handle.loads = []

    def _load(self, handle: CacheHandle, nodes: list[TreeNode]) -> None:
        """Start copying host-only ``nodes`` (a path, parents first) to the device."""
        fits = list(nodes)  # whole nodes only; shortened from the end when L1 is short
        total = sum(len(n.host_pages or ()) for n in fits)
        device_pages = self._alloc_device(total)
        while device_pages is None and fits:
            total -= len(fits.pop().host_pages or ())
            device_pages = self._alloc_device(total)
        if not fits or device_pages is None:
            self.counters.load_skipped_device_full += 1
            return
        host_pages = [p for n in fits for p in n.host_pages or ()]
        t = self.transfers.load(host_pages, device_pages)
        start = 0
        for node in fits:
            n = len(node.host_pages or ())
            self.tree.set_device(node, device_pages[start : start + n], t)
            start += n
        handle.loaded_nodes.extend(fits)
        self._add_load(handle, t, device_pages)

    def _add_load(self, handle: CacheHandle, t: Transfer, device_pages: list[int]) -> None:
        """Give ``handle`` the pages a load fills, as cached (host-hit) tokens."""
        handle.loads.append(t)
        handle.device_pages.extend(device_pages)
        tokens = len(device_pages) * self.page_size
        handle.num_cached_tokens += tokens
        handle.num_tokens += tokens
        handle.host_hit_tokens += tokens
        self.counters.loaded_pages += len(device_pages)
        self.counters.bytes_loaded += t.num_bytes

    def _load_extra(self, handle: CacheHandle, host_pages: list[int]) -> None:
        device_pages = self._alloc_device(len(host_pages))
        if device_pages is None:
            self.counters.load_skipped_device_full += 1
            self.host_pool.allocator.free(host_pages)
            return
        t = self.transfers.load(host_pages, device_pages)
        self.host_pool.allocator.free(host_pages, fence=t)
        handle.extra_pages = device_pages
        handle.num_reserved_pages += len(device_pages)
        self._num_private_pages += len(device_pages)
        self._add_load(handle, t, device_pages)

    def _drop_failed_load(self, handle: CacheHandle, t: Transfer) -> None:
        alloc = self.device_pool.allocator
        for load in handle.loads:  # other loads of the handle may still be copying
            if load is not t:
                with contextlib.suppress(TransferError):
                    load.wait()
        nodes = [n for n in handle.loaded_nodes if n.device_pending is not None]
        for node in reversed(nodes):
            alloc.free(self.tree.clear_device(node), fence=node.device_pending)  # type: ignore[arg-type]
        if handle.extra_pages:
            alloc.free(handle.extra_pages, fence=t)
            handle.num_reserved_pages -= len(handle.extra_pages)
            self._num_private_pages -= len(handle.extra_pages)
            handle.extra_pages = []
        handle.device_pages = handle.device_pages[: handle.device_hit_tokens // self.page_size]
        handle.num_cached_tokens = handle.num_tokens = handle.device_hit_tokens
        handle.host_hit_tokens = 0
        handle.loads, handle.loaded_nodes = [], []
