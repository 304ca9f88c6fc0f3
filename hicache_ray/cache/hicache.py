"""A single-process facade over one rank's L1/L2 cache, for a scheduler or engine loop.

The life of a request::

    handle = cache.match(tokens)          # lock the cached prefix, start loading its host part
    cache.wait_ready(handle)              # or handle.wait_layer(l) per layer in the forward
    pages = cache.reserve(handle, n)      # device pages for n new tokens (evicts if needed)
    ... write KV of the new tokens into those pages ...
    cache.finish(handle, tokens)          # insert whole pages, apply the write policy, unlock

``poll()`` reaps finished host writes (it is also called by every other entry point).
Everything runs on the caller's thread except the page copies (see ``memory.transfer``).
"""

from __future__ import annotations

import contextlib

import torch

from hicache_ray.base.config import CacheConfig
from hicache_ray.base.errors import HiCacheError, TransferError
from hicache_ray.base.layout import ShardKV, host_pool_pages
from hicache_ray.base.stats import CacheStats
from hicache_ray.base.tokens import TokenIds, encode_tokens
from hicache_ray.cache.handle import CacheFullError, CacheHandle
from hicache_ray.cache.loads import HostLoads
from hicache_ray.cache.memory import (
    DevicePool,
    HostPool,
    Transfer,
    TransferEngine,
    default_device,
    host_memory_budget,
)
from hicache_ray.cache.tree import HiRadixTree, TreeNode, write_rule

__all__ = ["HiCache"]


class HiCache(HostLoads):
    """One rank's device pool, host pool, transfer engine and prefix tree."""

    def __init__(
        self,
        config: CacheConfig,
        kv: ShardKV,
        *,
        device: torch.device | None = None,
        host_budget_bytes: int | None = None,
        num_copy_workers: int = 2,
    ) -> None:
        if kv.page_size != config.page_size:
            raise ValueError(f"kv.page_size={kv.page_size} differs from {config.page_size}")
        self.config = config
        self.kv = kv
        self.page_size = config.page_size
        budget = host_memory_budget() if host_budget_bytes is None else host_budget_bytes
        mem = config.memory
        device = device or default_device()
        # Sized (and refused) before either pool allocates a byte.
        host_pages = host_pool_pages(config, kv, budget, device_in_host_memory=device.type == "cpu")
        self.device_pool = DevicePool(kv, mem.num_device_pages, device)
        self.host_pool = HostPool(kv, host_pages, mem.mem_layout, layer_granule=mem.layer_granule)
        self.transfers = TransferEngine(self.device_pool, self.host_pool, num_copy_workers)
        self.tree = HiRadixTree(self.page_size, config.storage.tenant_salt)
        self.rule = write_rule(config.write)
        self.counters = CacheStats()
        self._writes: list[tuple[Transfer, list[TreeNode]]] = []  # in flight, FIFO
        # Reaped writes (nodes, ok) in submission order, until the controller acknowledges
        # them; num_completed_writes counts every write reaped since start.
        self.completed_writes: list[tuple[list[TreeNode], bool]] = []
        self.num_completed_writes = 0
        self._num_private_pages = 0  # device pages held by handles, not (yet) in the tree

    # --------------------------------------------------------------- requests

    def match(
        self,
        tokens: TokenIds,
        *,
        limit_pages: int | None = None,
        extra_host_pages: list[int] | None = None,
        salt: str = "",
    ) -> CacheHandle:
        """Match ``tokens``, lock the matched path and start loading its host part.

        Args:
            salt: the request's cache salt (its root in the tree; ``""``: the deployment's).
            limit_pages: use at most this many leading pages of the match (the length the
                ranks agreed on).
            extra_host_pages: host pages holding the KV of the pages right after the tree's
                match (a refill the tree could not take); they are loaded into device pages
                of this handle and freed, and the tree gets them at :meth:`finish`. Ignored
                (and freed) when the match is shorter than they assume.
        """
        self.poll()
        key = encode_tokens(tokens)
        if limit_pages is not None:
            key = key[: limit_pages * self.page_size * 4]
        m = self.tree.match_prefix(key, salt=salt)
        self.tree.lock(m.best_match_node)
        for node in self.tree.path(m.last_device_node):
            if self.rule.wants_write(node):
                self._write([node])
        handle = CacheHandle(
            key=key,
            device_pages=list(m.device_pages),
            num_cached_tokens=len(m.device_pages) * self.page_size,
            device_hit_tokens=len(m.device_pages) * self.page_size,
            host_hit_tokens=0,
            locked_node=m.best_match_node,
            loads=list(m.pending),  # type: ignore[arg-type]
            salt=salt,
        )
        if m.host_hit_pages:
            self._load(handle, self.tree.path(m.best_match_node, stop=m.last_device_node))
        if extra_host_pages:
            expected = len(m.device_pages) + m.host_hit_pages
            if handle.num_tokens == expected * self.page_size:
                self._load_extra(handle, extra_host_pages)
            else:
                self.host_pool.allocator.free(extra_host_pages)
        self.counters.device_hit_tokens += handle.device_hit_tokens
        self.counters.host_hit_tokens += handle.host_hit_tokens
        return handle

    def reserve(self, handle: CacheHandle, num_tokens: int) -> list[int]:
        """Device pages for ``num_tokens`` more tokens of ``handle``, evicting if needed.

        Raises:
            CacheFullError: the pool cannot hold them even after evicting every unlocked page.
        """
        self.poll()
        total = handle.num_tokens + num_tokens
        need_pages = max(0, -(-total // self.page_size) - len(handle.device_pages))
        pages = self._alloc_device(need_pages)
        if pages is None:
            raise CacheFullError(
                f"device pool has {self.device_pool.allocator.num_free_pages} free pages after "
                f"eviction; {need_pages} more needed (locked by running requests)"
            )
        handle.device_pages.extend(pages)
        handle.num_reserved_pages += len(pages)
        handle.num_tokens = total
        self._num_private_pages += len(pages)
        return pages

    def finish(self, handle: CacheHandle, tokens: TokenIds) -> int:
        """Insert the whole pages of ``tokens`` (the prefix plus computed tokens) and unlock.

        ``tokens`` must start with the tokens matched; their KV must be in
        ``handle.device_pages``. Returns the number of tokens now cached in the tree.
        """
        if handle.finished:
            raise HiCacheError("finish() called twice for one handle")
        key = encode_tokens(tokens)
        if not key.startswith(handle.key[: handle.num_cached_tokens * 4]):
            raise ValueError("finish(): tokens do not start with the matched prefix")
        num_pages = min(len(key) // (4 * self.page_size), len(handle.device_pages))
        result = self.tree.insert(key, handle.device_pages[:num_pages], salt=handle.salt)
        spare = handle.device_pages[num_pages:]
        self.device_pool.allocator.free(result.duplicate_pages + spare)
        self._num_private_pages -= handle.num_reserved_pages
        handle.finished = True
        early = self._prompt_nodes(handle)
        self.tree.unlock(handle.locked_node)
        self._write_wanted([*early, *result.new_nodes, *result.adopted_nodes])
        return num_pages * self.page_size

    def cache_prompt(self, handle: CacheHandle, key: bytes) -> int:
        """Insert the whole pages of a running request's computed prompt (``key``, as tree
        key bytes) now, not at :meth:`finish`: requests admitted while it runs hit them.
        The tree takes the pages, the request keeps them locked, and ``finish`` finds them
        in the tree. Skipped where the tree holds part of them in other pages (another
        request's copy: ``finish`` frees the duplicates then). Returns the pages taken.

        The write policy still acts at the request's end (``finish`` or ``release``): its
        L1 -> L2 copies (and so the L3 backups after them) running beside the request's own
        decode slowed decoding on CPU (trace replay: ITL p50 +10 %)."""
        owned = len(handle.device_pages) - handle.num_reserved_pages  # the tree's already
        num_pages = min(len(key) // (4 * self.page_size), len(handle.device_pages))
        if handle.finished or handle.loads or num_pages <= owned:
            return 0
        key = key[: num_pages * 4 * self.page_size]
        m = self.tree.match_prefix(key, salt=handle.salt, count_hit=False)
        if m.device_pages != handle.device_pages[:owned]:
            return 0
        result = self.tree.insert(key, handle.device_pages[:num_pages], salt=handle.salt)
        assert not result.duplicate_pages, "the match above rules duplicates out"
        deepest = (result.new_nodes or result.adopted_nodes)[-1]
        self.tree.lock(deepest)
        self.tree.unlock(handle.locked_node)
        handle.locked_node = deepest
        taken = num_pages - owned
        handle.num_reserved_pages -= taken
        self._num_private_pages -= taken
        handle.extra_pages = []  # the tree's now
        self.counters.prompt_pages_cached += taken
        handle.prompt_cached = True
        return taken

    def release(self, handle: CacheHandle) -> None:
        """Give up a handle without inserting anything (the request failed or was aborted)."""
        if handle.finished:
            return
        self.wait_ready(handle)
        reserved = handle.device_pages[len(handle.device_pages) - handle.num_reserved_pages :]
        self.device_pool.allocator.free(reserved)
        self._num_private_pages -= handle.num_reserved_pages
        handle.finished = True
        early = self._prompt_nodes(handle)
        self.tree.unlock(handle.locked_node)
        self._write_wanted(early)

    def _prompt_nodes(self, handle: CacheHandle) -> list[TreeNode]:
        """The path to the prompt pages :meth:`cache_prompt` inserted for ``handle`` (none
        if it inserted none), parents first: at the request's end the write policy acts on
        them (walked then: other inserts may have split them meanwhile)."""
        return self.tree.path(handle.locked_node) if handle.prompt_cached else []

    # ------------------------------------------------------------- background

    def poll(self) -> None:
        """Reap finished host writes: unlock their nodes, drop the host copy on failure."""
        while self._writes and self._writes[0][0].done:
            t, nodes = self._writes.pop(0)
            ok = t.ok
            for node in nodes:
                self.tree.unlock(node)
            if ok:
                self.counters.written_pages += len(t.host_pages)
                self.counters.bytes_written += t.num_bytes
                self.counters.writes += 1
                self.counters.write_latency_s += t.latency_s or 0.0
            else:
                self.counters.write_failures += 1
                self._drop_host_copies(t)
            self.completed_writes.append((nodes, ok))
            self.num_completed_writes += 1

    def take_completed_writes(self, count: int) -> list[tuple[list[TreeNode], bool]]:
        """Remove and return the oldest ``count`` reaped writes (``(nodes, ok)``), once
        every rank has acknowledged them."""
        taken = self.completed_writes[:count]
        del self.completed_writes[:count]
        return taken

    @property
    def writes_in_flight(self) -> int:
        """L1 -> L2 writes submitted and not yet reaped."""
        return len(self._writes)

    @property
    def num_private_pages(self) -> int:
        """Device pages held by handles and not (yet) in the tree."""
        return self._num_private_pages

    def flush(self) -> None:
        """Wait for every host write in flight."""
        for t, _ in list(self._writes):
            with contextlib.suppress(TransferError):
                t.wait()
        self.poll()

    def close(self) -> None:
        self.flush()
        self.transfers.close()

    def evict_all(self) -> tuple[int, int]:
        """Evict every unlocked page of both pools (soak checks: after a drain, what is
        left is locked by running requests, or leaked). Returns the pages still in use
        (device, host)."""
        self.flush()
        device, host = self.device_pool.allocator, self.host_pool.allocator
        freed = self.tree.evict_device(device.num_used_pages)
        device.free(freed)
        self.counters.device_evicted_pages += len(freed)
        freed = self.tree.evict_host(host.num_used_pages)
        host.free(freed)
        self.counters.host_evicted_pages += len(freed)
        return device.num_used_pages, host.num_used_pages

    # -------------------------------------------------------------- internals

    def _alloc_device(self, num_pages: int) -> list[int] | None:
        alloc = self.device_pool.allocator
        hook = self._write_back if self.rule.on_evict else None
        while not alloc.can_allocate(num_pages):
            freed = self.tree.evict_device(num_pages - alloc.num_free_pages, hook)
            alloc.free(freed)
            self.counters.device_evicted_pages += len(freed)
            if alloc.can_allocate(num_pages) or not self._writes:
                break
            # Pages still being written to the host are locked; wait for the oldest write.
            with contextlib.suppress(TransferError):
                self._writes[0][0].wait()
            self.poll()
        return alloc.allocate(num_pages)

    def alloc_host(self, num_pages: int) -> list[int] | None:
        alloc = self.host_pool.allocator
        if not alloc.can_allocate(num_pages):
            freed = self.tree.evict_host(num_pages - alloc.num_free_pages)
            alloc.free(freed)
            self.counters.host_evicted_pages += len(freed)
        return alloc.allocate(num_pages)

    def _write_wanted(self, nodes: list[TreeNode]) -> None:
        """Apply the write policy to ``nodes`` (parents first)."""
        written = [n for n in nodes if self.rule.wants_write(n)]
        if written:
            self._write(written)

    def _write(self, nodes: list[TreeNode]) -> Transfer | None:
        """Start copying ``nodes`` (on device, no host copy) to the host; lock until done."""
        total = sum(len(n.device_pages or ()) for n in nodes)
        host_pages = self.alloc_host(total)
        if host_pages is None:
            self.counters.write_skipped_host_full += 1
            return None
        device_pages = [p for n in nodes for p in n.device_pages or ()]
        t = self.transfers.write(device_pages, host_pages)
        start = 0
        for node in nodes:
            n = len(node.device_pages or ())
            self.tree.set_host(node, host_pages[start : start + n], t)
            self.tree.lock(node)
            start += n
        self._writes.append((t, nodes))
        return t

    def _write_back(self, nodes: list[TreeNode]) -> None:
        """Eviction under write_back: copy victims to the host before they leave the device."""
        for node in nodes:
            self.tree.lock(node)  # keep host eviction away from the victims' own path
        try:
            t = self._write(nodes)
        finally:
            for node in nodes:
                self.tree.unlock(node)
        if t is None:
            return
        with contextlib.suppress(TransferError):
            t.wait()
        self.poll()

    def _drop_host_copies(self, t: Transfer) -> None:
        for node in [n for n in self.tree.nodes() if n.host_pending is t]:
            self.host_pool.allocator.free(self.tree.clear_host(node), fence=t)

    # --------------------------------------------------------------- checking

    def check_integrity(self, held_host_pages: int = 0) -> None:
        """Assert pool accounting: every used device page is the tree's or a handle's, every
        used host page the tree's or one of ``held_host_pages`` (running prefetches')."""
        self.tree.check_integrity()
        self.device_pool.check_integrity()
        self.host_pool.check_integrity()
        dev = self.device_pool.allocator
        assert dev.num_used_pages == self.tree.num_device_pages + self._num_private_pages, (
            f"device pages: {dev.num_used_pages} used, {self.tree.num_device_pages} in tree, "
            f"{self._num_private_pages} held by requests"
        )
        host = self.host_pool.allocator
        assert host.num_used_pages == self.tree.num_host_pages + held_host_pages, (
            f"host pages: {host.num_used_pages} used, {self.tree.num_host_pages} in tree, "
            f"{held_host_pages} held outside it"
        )
