"""The page hashes of a tree node: its pages' names in L3 and in cache events."""

from __future__ import annotations

from collections.abc import Callable

from hicache_ray.cache.tree.node import TreeNode
from hicache_ray.keys.page_hash import page_hashes

__all__ = ["node_page_hashes"]


def node_page_hashes(
    node: TreeNode, page_size: int, salt_of: Callable[[TreeNode], str]
) -> list[str]:
    """Page hashes of ``node``, chained from its root (whose salt ``salt_of`` gives, e.g.
    :meth:`Roots.salt_of`) through its ancestors; computed once and cached on the
    nodes (``TreeNode.page_hashes``; a split divides them)."""
    chain = []
    while not node.is_root and node.page_hashes is None:
        chain.append(node)
        assert node.parent is not None
        node = node.parent
    salt = ""
    if node.is_root:  # the chain starts from its salt
        prior, salt = b"", salt_of(node)
    else:
        prior = bytes.fromhex(node.page_hashes[-1])  # type: ignore[index]
    for n in reversed(chain):
        n.page_hashes = page_hashes(n.key, page_size, salt=salt or None, prior=prior)
        prior = bytes.fromhex(n.page_hashes[-1])
    return chain[0].page_hashes if chain else node.page_hashes  # type: ignore[return-value]
