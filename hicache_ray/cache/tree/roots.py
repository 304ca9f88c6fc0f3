"""The roots of one radix tree: the deployment's, and one per other cache salt (tenant)
while that salt holds a node. A root is the only kind of node with an empty key."""

from __future__ import annotations

from collections.abc import Iterator

from hicache_ray.cache.tree.node import TreeNode

__all__ = ["Roots"]


def _new_root() -> TreeNode:
    root = TreeNode(0, b"", None)  # never in an eviction heap: its id breaks no tie
    root.device_pages = []
    root.host_pages = []
    root.lock_ref = 1  # never evicted
    return root


class Roots:
    """Roots by salt; ``salt`` (and ``""``) name the deployment's own, ``default``."""

    def __init__(self, salt: str) -> None:
        self.salt = salt
        self.default = _new_root()
        self._by_salt: dict[str, TreeNode] = {}  # other salts' roots
        self._salt_of: dict[TreeNode, str] = {self.default: salt}

    def of(self, salt: str, *, create: bool = False) -> TreeNode:
        """The root of ``salt``'s prefixes. Without ``create``, an absent salt gets an
        empty root outside the tree (nothing matches under it)."""
        if not salt or salt == self.salt:
            return self.default
        root = self._by_salt.get(salt)
        if root is None:
            root = _new_root()
            if create:
                self._by_salt[salt] = root
                self._salt_of[root] = salt
        return root

    def salt_of(self, root: TreeNode) -> str:
        """The salt that names the pages under ``root`` (the L3 keys' tenant salt)."""
        return self._salt_of.get(root, self.salt)

    def salt_of_node(self, node: TreeNode) -> str:
        """The salt of the root ``node`` hangs under."""
        while not node.is_root:
            assert node.parent is not None
            node = node.parent
        return self.salt_of(node)

    def forget_if_empty(self, root: TreeNode) -> None:
        """Drop a tenant's root once it holds no node."""
        if not root.children and root is not self.default:
            salt = self._salt_of.pop(root, None)
            if salt is not None:
                del self._by_salt[salt]

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self._salt_of)

    def __len__(self) -> int:
        """Salts other than the deployment's with a node in the tree."""
        return len(self._by_salt)

    def check(self) -> None:
        """Assert the roots' bookkeeping (tests)."""
        assert set(self._by_salt.values()) | {self.default} == set(self._salt_of), "roots"
        assert all(r.children for r in self._by_salt.values()), "an empty tenant root is kept"
