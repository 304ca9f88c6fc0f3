"""The hierarchical radix tree: which token prefixes are cached, and in which tier.

Control plane only: it records page ids and returns those it stops using; the caller owns
the pools and frees them. Not thread-safe: one rank's scheduler thread drives it.

Invariants (checked by :meth:`HiRadixTree.check_integrity`):
  * keys are whole pages; a child is indexed by the first page of its key;
  * device residency is closed towards the root: a node on the device has a parent on the
    device (or the root), so the device-ready part of a match is a prefix of it;
  * a node's ``lock_ref`` counts locks on it and on its descendants, so a locked path is
    never evicted from either tier; ``host_lock_ref`` likewise, from the host tier only
    (a backup reads the host copy; the device copy may go meanwhile);
  * a non-root node without children holds KV in some tier (dead leaves are deleted).

Tenants: each cache salt (``salt=`` of match, insert, insert_host) has a root of its own
(:mod:`~hicache_ray.cache.tree.roots`), so two salts never share a node, a page or a hit;
the pools and their LRU are shared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from hicache_ray.base.tokens import TOKEN_BYTES, TokenIds, encode_tokens
from hicache_ray.cache.tree.eviction import evict_device_lru, evict_host_lru
from hicache_ray.cache.tree.integrity import Tally, check_tree
from hicache_ray.cache.tree.node import SILENT, InsertResult, MatchResult, Pending, Tier, TreeNode
from hicache_ray.cache.tree.roots import Roots
from hicache_ray.cache.tree.tokens import common_pages

__all__ = ["HiRadixTree"]


class HiRadixTree:
    """Radix tree over token pages with a device value and a host value per node."""

    def __init__(self, page_size: int, salt: str = "") -> None:
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES  # one page of key bytes
        self._next_id = 1
        self.roots = Roots(salt)
        self.root = self.roots.default
        self._clock = 0
        self._device_leaves: set[TreeNode] = set()  # on device, no child on device
        self._host_leaves: set[TreeNode] = set()  # not on device, no children
        self.num_device_pages = 0
        self.num_host_pages = 0
        self.num_nodes = 0
        self.observer = SILENT  # told of every tier change (cache events)

    # ------------------------------------------------------------------ queries

    def match_prefix(
        self, tokens: TokenIds, *, salt: str = "", count_hit: bool = True
    ) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages only) under ``salt``'s root.

        Updates recency (and, with ``count_hit``, hit counts) of the matched nodes, and
        splits a node the match ends inside of (which changes no cached content).
        """
        page = self._page_bytes
        key = encode_tokens(tokens)
        n = len(key) - len(key) % page
        self._clock += 1
        now = self._clock
        node, pos = self.roots.of(salt), 0
        device_pages: list[int] = []
        pending: list[Pending] = []
        last_device = last_host = best = node
        host_hit, on_device = 0, True
        while pos < n:
            found = self._step(node, key, pos, n, now, live_only=True)
            if found is None:
                break
            child, klen = found
            child.hit_count += count_hit
            if on_device and child.device_pages is not None:
                device_pages.extend(child.device_pages)
                if child.device_pending is not None and not child.device_pending.done:
                    pending.append(child.device_pending)
                last_device = child
            else:
                on_device = False
                host_hit += klen // page
            if child.host_pages is not None:
                last_host = child
            best = child
            node, pos = child, pos + klen
        return MatchResult(device_pages, last_device, last_host, best, host_hit, pending)

    def path(self, node: TreeNode, stop: TreeNode | None = None) -> list[TreeNode]:
        """Nodes from just below ``stop`` (default: its root) down to ``node``, in order."""
        out = []
        while node is not stop and not node.is_root:
            out.append(node)
            assert node.parent is not None
            node = node.parent
        out.reverse()
        return out

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the roots, parents before children."""
        stack = [c for root in self.roots for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---------------------------------------------------------------- mutations

    def insert(
        self, tokens: TokenIds, device_pages: Sequence[int], *, salt: str = ""
    ) -> InsertResult:
        """Record that ``device_pages`` hold the KV of the first ``len(device_pages)`` pages
        (under ``salt``'s root).

        ``tokens`` must cover those pages; extra tokens are ignored.
        """
        page = self._page_bytes
        n = len(device_pages) * page
        key = encode_tokens(tokens)
        if len(key) < n:
            raise ValueError(
                f"{len(device_pages)} pages need {n // TOKEN_BYTES} tokens, "
                f"got {len(key) // TOKEN_BYTES}"
            )
        key = key[:n]
        self._clock += 1
        now = self._clock
        result = InsertResult()
        node, pos = self.roots.of(salt, create=n > 0), 0
        while pos < n:
            first = pos // page
            found = self._step(node, key, pos, n, now)
            if found is None:
                new = self._add_child(node, key[pos:], now)
                self._set_device(new, list(device_pages[first:]))
                new.hit_count = 1
                result.new_nodes.append(new)
                break
            child, klen = found
            segment = list(device_pages[first : first + klen // page])
            if child.device_pages is None:
                self._set_device(child, segment)
                result.adopted_nodes.append(child)
            elif child.device_pages != segment:
                result.duplicate_pages.extend(segment)
            node, pos = child, pos + klen
        return result

    def insert_host(
        self, tokens: TokenIds, start_page: int, host_pages: Sequence[int], *, salt: str = ""
    ) -> InsertResult:
        """Record host-only KV (e.g. read from storage) for pages ``[start_page, start_page
        + len(host_pages))`` of ``tokens``, whose first ``start_page`` pages are in the tree
        (under ``salt``'s root).

        Pages the tree already holds in some tier come back in ``duplicate_pages``; a
        node on the device without a host copy adopts the caller's pages as its host copy.

        Raises:
            ValueError: ``tokens`` are too short, or the first ``start_page`` pages are not
                all in the tree.
        """
        page = self._page_bytes
        start = start_page * page
        end = start + len(host_pages) * page
        key = encode_tokens(tokens)
        if len(key) < end:
            raise ValueError(f"{end // TOKEN_BYTES} tokens needed, got {len(key) // TOKEN_BYTES}")
        key = key[:end]
        self._clock += 1
        now = self._clock
        result = InsertResult()
        node, pos = self.roots.of(salt, create=end > start), 0
        while pos < end:
            # a node straddling the start is split there, so adopted nodes start with it
            found = self._step(node, key, pos, start if pos < start else end, now)
            if found is None:
                if pos < start:
                    raise ValueError(f"page {pos // page} of the prefix is not in the tree")
                new = self._add_child(node, key[pos:], now)
                self.set_host(new, list(host_pages[(pos - start) // page :]), None)
                self._refresh(new)
                result.new_nodes.append(new)
                break
            child, klen = found
            if pos >= start:
                segment = list(host_pages[(pos - start) // page : (pos - start + klen) // page])
                if child.host_pages is None:
                    self.set_host(child, segment, None)
                    self._refresh(child)
                    result.adopted_nodes.append(child)
                else:
                    result.duplicate_pages.extend(segment)
            elif child.dead:
                raise ValueError(f"page {pos // page} of the prefix is not in the tree")
            node, pos = child, pos + klen
        return result

    def lock(self, node: TreeNode, *, host_only: bool = False) -> None:
        """Protect ``node`` and its ancestors from eviction in both tiers; ``host_only``:
        from host eviction only (``node`` has a host copy; its device pages may go)."""
        while not node.is_root:
            if host_only:
                node.host_lock_ref += 1
            else:
                node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: TreeNode, *, host_only: bool = False) -> None:
        """Undo one :meth:`lock` of ``node`` (the same ``host_only``)."""
        while not node.is_root:
            if (node.host_lock_ref if host_only else node.lock_ref) <= 0:
                raise RuntimeError(f"unlock of {node} which is not locked")
            if host_only:
                node.host_lock_ref -= 1
            else:
                node.lock_ref -= 1
            assert node.parent is not None
            node = node.parent

    def set_device(self, node: TreeNode, pages: list[int], pending: Pending | None) -> None:
        """Give a host-only node a device copy (a load into ``pages``, maybe in flight)."""
        if node.device_pages is not None:
            raise RuntimeError(f"{node} is already on the device")
        parent = node.parent
        if parent is not None and not parent.is_root and parent.evicted:
            raise RuntimeError(f"{node}: its parent is not on the device; load parents first")
        self._set_device(node, pages)
        node.device_pending = pending

    def clear_device(self, node: TreeNode) -> list[int]:
        """Drop the device copy of a node with no child on the device; returns its pages."""
        if node.num_device_children:
            raise RuntimeError(f"{node} has children on the device; clear them first")
        pages = node.device_pages or []
        if node.device_pages is not None:
            self._clear_device(node)
        if node.dead and not node.children:
            self._delete(node)
        return pages

    def set_host(self, node: TreeNode, pages: list[int], pending: Pending | None) -> None:
        """Record a host copy of ``node`` (a write into ``pages``, maybe in flight)."""
        if node.host_pages is not None:
            raise RuntimeError(f"{node} already has a host copy")
        if len(pages) != len(node.key) // self._page_bytes:
            raise ValueError(f"{node} needs {len(node.key) // self._page_bytes} host pages")
        node.host_pages = pages
        node.host_pending = pending
        self.num_host_pages += len(pages)
        self.observer.stored(node, Tier.HOST)

    def clear_host(self, node: TreeNode) -> list[int]:
        """Drop the host copy of ``node`` (e.g. its write failed); returns its pages."""
        pages = node.host_pages or []
        if node.host_pages is not None:
            self.observer.removed(node, Tier.HOST)
            node.host_pages = None
            node.host_pending = None
            self.num_host_pages -= len(pages)
            if node.dead and not node.children:
                self._delete(node)
        return pages

    def evict_device(
        self,
        num_pages: int,
        write_back: Callable[[list[TreeNode]], None] | None = None,
    ) -> list[int]:
        """Evict at least ``num_pages`` device pages, least recently used leaves first
        (strict LRU over leaves: a node whose last device child goes competes at once).

        ``write_back`` (write_back policy) is called with each batch of victims that have
        no host copy, before their device pages are dropped; it may give them one with
        :meth:`set_host`. A victim left without a host copy is deleted (or left dead when it
        still has host-only children). Locked nodes are never evicted. Returns the freed
        device pages (possibly fewer than asked when too much is locked).
        """
        return evict_device_lru(self._device_leaves, num_pages, self.clear_device, write_back)

    def evict_host(self, num_pages: int) -> list[int]:
        """Evict at least ``num_pages`` host pages from host-only leaves, LRU first."""
        return evict_host_lru(self._host_leaves, num_pages, self.clear_host)

    # ----------------------------------------------------------------- internals

    def _step(
        self, node: TreeNode, key: bytes, pos: int, limit: int, now: int, *, live_only: bool = False
    ) -> tuple[TreeNode, int] | None:
        """The one tree walk (match, insert and insert_host): the child of ``node`` that
        ``key[pos:]`` continues into and how many key bytes it covers, at most up to
        ``limit``; a child covered in part is split there first. The child (both halves
        of a split) is stamped as used at ``now``. None when no (live) child continues it."""
        child = node.children.get(key[pos : pos + self._page_bytes])
        if child is None or (live_only and child.dead):
            return None
        klen = len(child.key)
        if key[pos : pos + klen] != child.key:
            klen = common_pages(child.key, key, pos, self._page_bytes) * self._page_bytes
        klen = min(klen, limit - pos)
        child.last_access = now
        if klen < len(child.key):
            child = self._split(child, klen, now)
        return child, klen

    def _add_child(self, parent: TreeNode, key: bytes, now: int) -> TreeNode:
        node = TreeNode(self._next_id, key, parent)
        self._next_id += 1
        node.last_access = now
        parent.children[key[: self._page_bytes]] = node
        self.num_nodes += 1
        self._refresh(parent)
        return node

    def _split(self, child: TreeNode, split_len: int, now: int) -> TreeNode:
        """Split ``child`` so its first ``split_len`` key bytes become a new parent node;
        both halves are stamped as used at ``now`` (SGLang's RadixCache does the same)."""
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.key)
        mid = child.split_off(self._next_id, split_len, self._page_bytes, now)
        self._next_id += 1
        self.num_nodes += 1
        parent.children[mid.key[: self._page_bytes]] = mid
        self._refresh(mid)
        return mid

    def _set_device(self, node: TreeNode, pages: list[int]) -> None:
        if len(pages) != len(node.key) // self._page_bytes:
            raise ValueError(f"{node} needs {len(node.key) // self._page_bytes} device pages")
        node.device_pages = pages
        self.num_device_pages += len(pages)
        parent = node.parent
        assert parent is not None
        parent.num_device_children += 1
        self._refresh(node)
        self._refresh(parent)
        self.observer.stored(node, Tier.DEVICE)

    def _clear_device(self, node: TreeNode) -> None:
        assert node.device_pages is not None
        self.observer.removed(node, Tier.DEVICE)
        self.num_device_pages -= len(node.device_pages)
        node.device_pages = None
        node.device_pending = None
        parent = node.parent
        assert parent is not None
        parent.num_device_children -= 1
        self._refresh(node)
        self._refresh(parent)

    def _delete(self, node: TreeNode) -> None:
        """Remove a childless node with no KV left in any tier; dead parents follow, and a
        tenant's root that holds nothing more."""
        while not node.is_root and node.dead and not node.children and not node.host_locked:
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self._page_bytes]]
            self._device_leaves.discard(node)
            self._host_leaves.discard(node)
            self.num_nodes -= 1
            node.parent = None
            self._refresh(parent)
            node = parent
        if node.is_root:
            self.roots.forget_if_empty(node)

    def _refresh(self, node: TreeNode) -> None:
        """Recompute which leaf sets ``node`` belongs to."""
        if node.is_root:
            return
        if node.device_pages is not None and not node.num_device_children:
            self._device_leaves.add(node)
        else:
            self._device_leaves.discard(node)
        if node.device_pages is None and not node.children:
            self._host_leaves.add(node)
        else:
            self._host_leaves.discard(node)

    # ----------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Assert every invariant in the module docstring and the page counters."""
        self.roots.check()
        counted = check_tree(list(self.roots), self.page_size)
        kept = Tally(self.num_nodes, self.num_device_pages, self.num_host_pages)
        kept.device_leaves, kept.host_leaves = self._device_leaves, self._host_leaves
        assert counted == kept, f"the tree's counters differ from a walk: {kept} != {counted}"
