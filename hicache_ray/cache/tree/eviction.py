"""The radix tree's eviction: least recently used leaves first, in strict LRU order over
leaves (every tenant's: the pools are shared)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from hicache_ray.cache.tree.node import TreeNode

__all__ = ["evict_device_lru", "evict_host_lru", "lru_batch"]

Clear = Callable[[TreeNode], list[int]]


def evict_device_lru(
    leaves: set[TreeNode],
    num_pages: int,
    clear: Clear,
    write_back: Callable[[list[TreeNode]], None] | None,
) -> list[int]:
    """:meth:`HiRadixTree.evict_device` over the tree's device ``leaves``; ``clear``
    drops one node's device copy and returns its pages."""
    heap = [(n.last_access, n.id, n) for n in leaves if not n.lock_ref]
    heapq.heapify(heap)
    freed: list[int] = []
    while len(freed) < num_pages and heap:
        batch = lru_batch(heap, num_pages - len(freed))
        if write_back is not None:
            unwritten = [n for n in batch if n.host_pages is None]
            if unwritten:
                write_back(unwritten)
        for node in batch:  # children before their parents
            freed.extend(clear(node))
    return freed


def evict_host_lru(leaves: set[TreeNode], num_pages: int, clear: Clear) -> list[int]:
    """:meth:`HiRadixTree.evict_host` over the tree's host-only ``leaves``; ``clear``
    drops one node's host copy (deleting it) and returns its pages."""
    heap = [(n.last_access, n.id, n) for n in leaves if not n.host_locked]
    heapq.heapify(heap)
    freed: list[int] = []
    while len(freed) < num_pages and heap:
        node = heapq.heappop(heap)[2]
        if node.host_locked or node.device_pages is not None or node.children:
            continue
        parent = node.parent
        freed.extend(clear(node))  # a host-only leaf: deleted with its copy
        if parent is not None and parent in leaves and not parent.host_locked:
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return freed


def lru_batch(heap: list[tuple[int, int, TreeNode]], want: int) -> list[TreeNode]:
    """Pop from ``heap`` (``(last_access, id, node)`` of unlocked device leaves) the nodes
    whose device pages add up to at least ``want``, children before their parents.

    A parent whose device children are all chosen is a leaf from then on and competes at
    once (pushed onto ``heap``; it is cleared after them). Nodes that stopped being
    evictable since they were pushed are skipped.
    """
    batch: list[TreeNode] = []
    leaving: dict[TreeNode, int] = {}  # device children chosen, per parent
    while heap and want > 0:
        node = heapq.heappop(heap)[2]
        left = node.num_device_children - leaving.get(node, 0)
        if node.lock_ref or node.device_pages is None or left:
            continue
        batch.append(node)
        want -= len(node.device_pages)
        parent = node.parent
        if parent is None or parent.is_root or parent.lock_ref:  # a root stays
            continue
        leaving[parent] = leaving.get(parent, 0) + 1
        if parent.device_pages is not None and leaving[parent] == parent.num_device_children:
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return batch
