"""Nodes of the hierarchical radix tree and the result of a prefix match."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "BackupMark",
    "InsertResult",
    "MatchResult",
    "Pending",
    "SILENT",
    "Tier",
    "TierObserver",
    "TreeNode",
]


class BackupMark(enum.Enum):
    """A node's L3 backup state when no backup task stands for it."""

    FAILED = "failed"  # a backup of its pages failed on some rank (a later write retries)
    WAITING = "waiting"  # its parent has no host copy yet: backed up once the parent is


class Tier(enum.Enum):
    """The tiers a node's KV may live in (L3 is the storage's, not the tree's)."""

    DEVICE = "device"  # L1
    HOST = "host"  # L2


class TierObserver(Protocol):
    """Told each time a node gains or loses its copy in a tier (cache events)."""

    def stored(self, node: TreeNode, tier: Tier) -> None: ...

    def removed(self, node: TreeNode, tier: Tier) -> None: ...

    def backed_up(self, node: TreeNode) -> None:
        """Told once every rank acknowledged ``node``'s backup to the shared store."""


class _Silent:
    """The observer of a tree nobody listens to."""

    def stored(self, node: TreeNode, tier: Tier) -> None:
        pass

    def removed(self, node: TreeNode, tier: Tier) -> None:
        pass

    def backed_up(self, node: TreeNode) -> None:
        pass


SILENT: TierObserver = _Silent()


class Pending(Protocol):
    """An in-flight copy into a node's pages (a Transfer satisfies it)."""

    @property
    def done(self) -> bool: ...

    @property
    def ok(self) -> bool: ...


class TreeNode:
    """A run of whole pages of tokens, with where its KV lives.

    ``key`` holds the tokens as uint32 little-endian bytes (whole pages); ``device_pages``
    and ``host_pages`` hold one page id per page of the key, or None when the tier holds no
    copy. A node whose copy into a tier is still in flight carries the copy in
    ``device_pending`` / ``host_pending``; after a split both halves share it.

    States: on device (``device_pages`` set), ``evicted`` (not on device), ``backed_up`` (a
    completed host copy), dead (neither: its subtree cannot be reached by a match).

    ``page_hashes`` caches the storage page hashes of the key (filled by whoever needs
    them; a split divides it), and ``backup`` the state of the node's L3 backup: None
    (never asked), the latest backup task (the controller's, seen as a :class:`Pending`), or a
    :class:`BackupMark`.
    """

    __slots__ = (
        "backup",
        "children",
        "device_pages",
        "device_pending",
        "hit_count",
        "host_lock_ref",
        "host_pages",
        "host_pending",
        "id",
        "key",
        "last_access",
        "lock_ref",
        "num_device_children",
        "page_hashes",
        "parent",
    )

    def __init__(self, node_id: int, key: bytes, parent: TreeNode | None) -> None:
        self.id = node_id
        self.key = key
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.device_pages: list[int] | None = None
        self.host_pages: list[int] | None = None
        self.device_pending: Pending | None = None
        self.host_pending: Pending | None = None
        self.lock_ref = 0
        self.host_lock_ref = 0  # locks against host eviction only (a backup reading it)
        self.hit_count = 0
        self.last_access = 0
        self.num_device_children = 0
        self.page_hashes: list[str] | None = None
        self.backup: Pending | BackupMark | None = None  # the controller's backup task

    def split_off(self, new_id: int, split_len: int, page_bytes: int, now: int) -> TreeNode:
        """A new node for the first ``split_len`` key bytes of this one, put between it and
        its parent (the caller indexes it under the parent). What the whole node had, both
        halves have: copies in flight, backup state, locks (a lock on this node covers its
        ancestors) and hits; pages and page hashes are divided."""
        assert self.parent is not None
        mid = TreeNode(new_id, self.key[:split_len], self.parent)
        cut = split_len // page_bytes
        if self.device_pages is not None:
            mid.device_pages, self.device_pages = self.device_pages[:cut], self.device_pages[cut:]
        if self.host_pages is not None:
            mid.host_pages, self.host_pages = self.host_pages[:cut], self.host_pages[cut:]
        if self.page_hashes is not None:
            mid.page_hashes, self.page_hashes = self.page_hashes[:cut], self.page_hashes[cut:]
        mid.backup = self.backup
        mid.device_pending = self.device_pending
        mid.host_pending = self.host_pending
        mid.lock_ref = self.lock_ref
        mid.host_lock_ref = self.host_lock_ref
        mid.hit_count = self.hit_count
        mid.last_access = self.last_access = now
        self.key = self.key[split_len:]
        self.parent = mid
        mid.children[self.key[:page_bytes]] = self
        mid.num_device_children = 0 if self.device_pages is None else 1
        return mid

    def pages(self, tier: Tier) -> list[int] | None:
        """The node's pages in ``tier`` (None: no copy there)."""
        return self.device_pages if tier is Tier.DEVICE else self.host_pages

    @property
    def is_root(self) -> bool:
        """A root of the tree (one per tenant salt): the only nodes with an empty key."""
        return not self.key

    @property
    def evicted(self) -> bool:
        return self.device_pages is None

    @property
    def backed_up(self) -> bool:
        """A host copy exists and its write has completed."""
        if self.host_pages is None:
            return False
        pending = self.host_pending
        return pending is None or (pending.done and pending.ok)

    @property
    def dead(self) -> bool:
        return self.device_pages is None and self.host_pages is None

    @property
    def num_pages(self) -> int:
        return len(self.device_pages if self.device_pages is not None else self.host_pages or ())

    @property
    def host_locked(self) -> bool:
        """Locked against host eviction (by either kind of lock)."""
        return bool(self.lock_ref or self.host_lock_ref)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key) // 4}, "
            f"device={self.device_pages is not None}, host={self.host_pages is not None}, "
            f"lock={self.lock_ref}, host_lock={self.host_lock_ref})"
        )


@dataclass
class MatchResult:
    """What :meth:`HiRadixTree.match_prefix` found for a token sequence.

    Attributes:
        device_pages: device page ids of the longest prefix on the device, in order.
        last_device_node: deepest node of that prefix (the root when nothing matched).
        last_host_node: deepest matched node with a host copy.
        best_match_node: deepest node present in L1 or L2; the host-only part of the match is
            the path from ``last_device_node`` (exclusive) to here.
        host_hit_pages: pages of the match past the device prefix (their KV is on the host).
        pending: copies into the matched device pages still in flight; wait on them before
            reading those pages.
    """

    device_pages: list[int]
    last_device_node: TreeNode
    last_host_node: TreeNode
    best_match_node: TreeNode
    host_hit_pages: int
    pending: list[Pending] = field(default_factory=list)

    @property
    def num_device_pages(self) -> int:
        return len(self.device_pages)


@dataclass
class InsertResult:
    """What :meth:`HiRadixTree.insert` did with the caller's pages.

    Attributes:
        duplicate_pages: caller pages for a prefix the tree already held on the device under
            other pages; the caller frees them.
        new_nodes: nodes created for the caller's pages, in path order.
        adopted_nodes: existing host-only nodes that took the caller's pages as their device
            copy, in path order.
    """

    duplicate_pages: list[int] = field(default_factory=list)
    new_nodes: list[TreeNode] = field(default_factory=list)
    adopted_nodes: list[TreeNode] = field(default_factory=list)
