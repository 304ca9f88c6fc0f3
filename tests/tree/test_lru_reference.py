"""The tree's eviction is strict LRU over leaves: on any trace and capacity, the matched
lengths equal a brute-force reference (a naive radix tree with one root per tenant salt
that evicts the least recently used unlocked leaf of any tenant one at a time, splits
stamping both halves), and SGLang's RadixCache where it is importable."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_ray.cache.tree import HiRadixTree

PAGE = 2


@dataclass(eq=False)
class _Node:
    id: int
    key: tuple[int, ...]  # tokens, whole pages
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_access: int = 0
    lock: int = 0


class _Reference:
    """A naive radix tree of whole pages, device tier only, a root per tenant."""

    def __init__(self) -> None:
        self.roots: dict[int, _Node] = {}
        self.next_id = 1
        self.clock = 0
        self.pages = 0

    def _root(self, tenant: int) -> _Node:
        if tenant not in self.roots:
            self.roots[tenant] = _Node(0, (), None)
        return self.roots[tenant]

    def _split(self, child: _Node, n: int, now: int) -> _Node:
        parent = child.parent
        assert parent is not None
        mid = _Node(self.next_id, child.key[:n], parent)
        self.next_id += 1
        del parent.children[child.key[:PAGE]]
        parent.children[mid.key[:PAGE]] = mid
        child.key = child.key[n:]
        child.parent = mid
        mid.children[child.key[:PAGE]] = child
        mid.lock = child.lock
        mid.last_access = child.last_access = now
        return mid

    def _walk(self, tokens: tuple[int, ...], now: int, tenant: int) -> tuple[_Node, int]:
        """Deepest node matching a prefix of ``tokens`` (splitting), and its length."""
        node, pos = self._root(tenant), 0
        while pos + PAGE <= len(tokens):
            child = node.children.get(tokens[pos : pos + PAGE])
            if child is None:
                break
            n = 0
            while (
                n < len(child.key) and tokens[pos + n : pos + n + PAGE] == child.key[n : n + PAGE]
            ):
                n += PAGE
            child.last_access = now
            if n < len(child.key):
                child = self._split(child, n, now)
            node, pos = child, pos + n
        return node, pos

    def match(self, tokens: tuple[int, ...], tenant: int) -> tuple[_Node, int]:
        self.clock += 1
        return self._walk(tokens[: len(tokens) - len(tokens) % PAGE], self.clock, tenant)

    def insert(self, tokens: tuple[int, ...], tenant: int) -> None:
        self.clock += 1
        whole = tokens[: len(tokens) - len(tokens) % PAGE]
        node, pos = self._walk(whole, self.clock, tenant)
        if pos < len(whole):
            new = _Node(self.next_id, whole[pos:], node, last_access=self.clock)
            self.next_id += 1
            node.children[new.key[:PAGE]] = new
            self.pages += len(new.key) // PAGE

    def evict(self, pages: int) -> int:
        freed = 0
        while freed < pages:
            leaves = [n for n in self._nodes() if not n.children and not n.lock]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: (n.last_access, n.id))
            assert victim.parent is not None
            del victim.parent.children[victim.key[:PAGE]]
            freed += len(victim.key) // PAGE
        self.pages -= freed
        return freed

    def _nodes(self) -> list[_Node]:
        out, stack = [], [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def set_lock(self, node: _Node, delta: int) -> None:
        while node.key:
            node.lock += delta
            assert node.parent is not None
            node = node.parent


def _salt(tenant: int) -> str:
    return f"tenant-{tenant}" if tenant else ""  # 0: the deployment's own


def _replay(
    trace: list[list[int]], capacity: int, tenants: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """Matched pages per request on the tree and on the reference, each request locking
    its match while room is made for the rest of it and it is inserted (request ``i`` of
    tenant ``tenants[i]``: its own root)."""
    tree, ref = HiRadixTree(PAGE), _Reference()
    free = list(range(capacity))
    got, want = [], []
    for i, tokens in enumerate(trace):
        tenant = tenants[i % len(tenants)] if tenants else 0
        pages = len(tokens) // PAGE
        m = tree.match_prefix(tokens, salt=_salt(tenant))
        node, matched = ref.match(tuple(tokens), tenant)
        got.append(len(m.device_pages))
        want.append(matched // PAGE)
        need = pages - len(m.device_pages)
        tree.lock(m.last_device_node)
        ref.set_lock(node, 1)
        if len(free) < need:
            free += tree.evict_device(need - len(free))
            ref.evict(need - (capacity - ref.pages))
        if len(free) >= need:
            mine = [free.pop() for _ in range(need)]
            result = tree.insert(tokens, m.device_pages + mine, salt=_salt(tenant))
            free += result.duplicate_pages
            ref.insert(tuple(tokens), tenant)
        tree.unlock(m.last_device_node)
        ref.set_lock(node, -1)
        tree.check_integrity()
        assert tree.num_device_pages == ref.pages
    return got, want


_TRACES = st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=14), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(trace=_TRACES, capacity=st.integers(7, 24))
def test_matched_lengths_equal_a_brute_force_strict_lru(
    trace: list[list[int]], capacity: int
) -> None:
    got, want = _replay(trace, capacity)
    assert got == want


@settings(max_examples=150, deadline=None)
@given(
    trace=_TRACES,
    capacity=st.integers(7, 24),
    tenants=st.lists(st.integers(0, 2), min_size=1, max_size=5),
)
def test_tenants_match_only_their_own_prefixes_under_one_lru(
    trace: list[list[int]], capacity: int, tenants: list[int]
) -> None:
    """Salted requests never match another salt's pages; eviction stays one strict LRU
    over every tenant's leaves (the reference keeps a root per tenant)."""
    got, want = _replay(trace, capacity, tenants)
    assert got == want


def test_a_parent_that_becomes_a_leaf_competes_at_once() -> None:
    """[a b] then [a b c]: evicting one page takes the child, then (older than a fresh
    leaf) its parent, not the fresh leaf."""
    trace = [[1, 1, 2, 2], [1, 1, 2, 2, 3, 3], [5, 5], [7, 7, 7, 7]]
    got, want = _replay(trace, 4)
    assert got == want
