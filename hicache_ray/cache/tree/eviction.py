"""Choosing the device-eviction victims of the radix tree: least recently used leaves, in
strict LRU order over leaves."""

from __future__ import annotations

import heapq

from hicache_ray.cache.tree.node import TreeNode

__all__ = ["lru_batch"]


def lru_batch(heap: list[tuple[int, int, TreeNode]], want: int, root: TreeNode) -> list[TreeNode]:
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
        if parent is None or parent is root or parent.lock_ref:
            continue
        leaving[parent] = leaving.get(parent, 0) + 1
        if parent.device_pages is not None and leaving[parent] == parent.num_device_children:
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return batch
