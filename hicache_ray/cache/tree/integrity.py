"""The invariant check of :class:`~hicache_ray.cache.tree.radix_tree.HiRadixTree` (tests,
soak runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache_ray.base.tokens import TOKEN_BYTES
from hicache_ray.cache.tree.node import TreeNode

__all__ = ["Tally", "check_tree"]


@dataclass
class Tally:
    """What a walk of the tree counted (the tree compares it with its own counters)."""

    nodes: int = 0
    device_pages: int = 0
    host_pages: int = 0
    device_leaves: set[TreeNode] = field(default_factory=set)
    host_leaves: set[TreeNode] = field(default_factory=set)


def check_tree(roots: list[TreeNode], page_size: int) -> Tally:
    """Assert every invariant in the radix tree's module docstring below ``roots`` (no
    page is in two of them); the counts, for the caller to compare with its counters."""
    page = page_size * TOKEN_BYTES
    device_total = host_total = count = 0
    seen_device: set[int] = set()
    seen_host: set[int] = set()
    device_leaves: set[TreeNode] = set()
    host_leaves: set[TreeNode] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        lock_sum = host_lock_sum = 0
        device_children = 0
        for first, child in node.children.items():
            assert child.parent is node, f"{child}: wrong parent"
            assert child.key[:page] == first, f"{child}: indexed under another page"
            lock_sum += child.lock_ref
            host_lock_sum += child.host_lock_ref
            device_children += child.device_pages is not None
            stack.append(child)
        root = node.is_root
        assert root or node.lock_ref >= lock_sum, f"{node}: lock below children's"
        assert root or node.host_lock_ref >= host_lock_sum, f"{node}: host lock"
        assert node.num_device_children == device_children, f"{node}: device child count"
        if root:
            continue
        count += 1
        pages = len(node.key) // page
        assert node.key and len(node.key) % page == 0, f"{node}: key not whole pages"
        assert node.lock_ref >= 0 and node.host_lock_ref >= 0, f"{node}: negative lock"
        assert node.children or not node.dead, f"{node}: dead leaf"
        parent = node.parent
        assert parent is not None
        if node.device_pages is not None:
            assert len(node.device_pages) == pages, f"{node}: device page count"
            assert parent.is_root or parent.device_pages is not None, (
                f"{node}: on device under an evicted parent"
            )
            assert seen_device.isdisjoint(node.device_pages), f"{node}: device page reused"
            seen_device.update(node.device_pages)
            device_total += pages
            if not device_children:
                device_leaves.add(node)
        elif not node.children:
            host_leaves.add(node)
        if node.host_pages is not None:
            assert len(node.host_pages) == pages, f"{node}: host page count"
            assert seen_host.isdisjoint(node.host_pages), f"{node}: host page reused"
            seen_host.update(node.host_pages)
            host_total += pages
    return Tally(count, device_total, host_total, device_leaves, host_leaves)
