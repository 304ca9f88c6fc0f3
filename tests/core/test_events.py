"""Cache events: replaying a tree's journal rebuilds exactly what it holds per tier, on
random traces with loads, host copies, evictions in both tiers, dropped batches and
re-formed trees; the records are vLLM's schema."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hicache_ray.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvents,
    EventBatch,
    KVEventBatch,
    check_position,
)
from hicache_ray.cache.tree import HiRadixTree, TreeNode, node_page_hashes
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import CacheIndex, Hits

PAGE = 2
SALT = "tenant-a"
_FAMILIES = [[f * 100 + i for i in range(12)] for f in range(3)]

# (op, argument): insert a prompt of family f cut at n pages; copy device nodes to host;
# evict k device pages (writing some back to host); evict k host pages; flush a batch
# (dropped when the argument is odd); re-form (a new tree and journal).
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.tuples(st.integers(0, 2), st.integers(1, 6))),
        st.tuples(st.just("host"), st.integers(0, 3)),
        st.tuples(st.just("evict_device"), st.integers(1, 6)),
        st.tuples(st.just("evict_host"), st.integers(1, 6)),
        st.tuples(st.just("flush"), st.integers(0, 3)),
        st.tuples(st.just("reform"), st.just(0)),
    ),
    max_size=40,
)


class _Replica:
    """A tree with its journal, its page ids from a counter."""

    def __init__(self) -> None:
        self.tree = HiRadixTree(PAGE, SALT)
        self.journal = CacheEvents(self.tree)
        self.tree.observer = self.journal
        self.ids = itertools.count()

    def pages(self, n: int) -> list[int]:
        return [next(self.ids) for _ in range(n)]

    def run(self, op: str, arg: Any) -> None:
        tree = self.tree
        if op == "insert":
            family, n = arg
            m = tree.match_prefix(_FAMILIES[family][: n * PAGE])
            tree.insert(_FAMILIES[family], m.device_pages + self.pages(n - len(m.device_pages)))
        elif op == "host":  # a host copy is written from the device copy
            copyable = [n for n in tree.nodes() if n.host_pages is None and not n.evicted]
            for node in copyable[: arg + 1]:
                tree.set_host(node, self.pages(node.num_pages), None)
        elif op == "evict_device":
            tree.evict_device(arg, write_back=self._write_back if arg % 2 else None)
        elif op == "evict_host":
            tree.evict_host(arg)

    def _write_back(self, nodes: list[TreeNode]) -> None:
        for node in nodes[::2]:
            self.tree.set_host(node, self.pages(node.num_pages), None)

    def held(self) -> dict[str, set[str]]:
        """The page hashes the tree holds, per medium (from a walk, not from events)."""
        out: dict[str, set[str]] = {"GPU": set(), "CPU": set()}
        for node in self.tree.nodes():
            hashes = node_page_hashes(node, PAGE, self.tree.roots.salt_of)
            if node.device_pages is not None:
                out["GPU"].update(hashes)
            if node.host_pages is not None:
                out["CPU"].update(hashes)
        return out


def _subscribe(index: CacheIndex, replica: _Replica, drop: bool) -> None:
    """What a subscriber does after a flush: the next batches, or a snapshot on a gap."""
    seq = replica.journal.flush()
    if drop:
        return
    epoch, applied = index.position("r")
    batches = replica.journal.since(applied) if epoch == replica.journal.epoch else None
    if batches is None or not all(index.apply("r", b) for b in batches):
        index.reset("r", replica.journal.snapshot())
    assert index.position("r") == (replica.journal.epoch, seq)


def _index_pages(index: CacheIndex, replica: _Replica) -> dict[str, set[str]]:
    r = index._replicas["r"]
    return {medium: set(held) for medium, held in r.pages.items()}


@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
# a node evicted from both tiers but kept for a child's host copy is not copied to host
@example(ops=[("insert", (2, 1)), ("insert", (2, 2)), ("evict_device", 3), ("host", 0)])
def test_replaying_the_events_rebuilds_the_tree_per_tier(ops: list[tuple[str, Any]]) -> None:
    replica, index = _Replica(), CacheIndex()
    for op, arg in ops:
        if op == "flush":
            _subscribe(index, replica, drop=bool(arg % 2))
        elif op == "reform":
            replica = _Replica()
        else:
            replica.run(op, arg)
        replica.tree.check_integrity()
    _subscribe(index, replica, drop=False)
    assert _index_pages(index, replica) == replica.held()


def test_a_dropped_batch_is_detected_and_healed_by_a_snapshot() -> None:
    replica, index = _Replica(), CacheIndex()
    replica.run("insert", (0, 4))
    replica.journal.flush()
    first = replica.journal.since(0)
    assert first is not None and index.apply("r", first[0]) is False  # never reset: unknown
    index.reset("r", first[0])
    replica.run("insert", (1, 3))
    replica.journal.flush()  # seq 2 is lost on the way; seq 3 arrives
    replica.run("evict_device", 3)
    replica.journal.flush()
    latest = replica.journal.since(2)
    assert latest is not None and [b.seq for b in latest] == [3]
    assert index.apply("r", latest[0]) is False  # the gap is seen, nothing applied
    index.reset("r", replica.journal.snapshot())
    assert _index_pages(index, replica) == replica.held()
    assert index.position("r") == (replica.journal.epoch, 3)


def test_old_batches_are_not_kept_forever() -> None:
    tree = HiRadixTree(PAGE)
    journal = CacheEvents(tree, keep_batches=2)
    tree.observer = journal
    for i in range(4):
        tree.insert(_FAMILIES[0][: (i + 1) * PAGE], list(range(i + 1)))
        journal.flush()
    assert journal.since(0) is None and [b.seq for b in journal.since(2) or []] == [3, 4]
    assert journal.since(4) == [] and journal.flush() == 4  # nothing queued: no batch


def test_hits_count_leading_pages_per_tier() -> None:
    replica, index = _Replica(), CacheIndex()
    replica.run("insert", (0, 4))
    replica.run("insert", (0, 6))  # a second node of 2 pages under the first
    replica.tree.evict_device(2, write_back=lambda nodes: replica._write_back(nodes * 2))
    index.reset("r", replica.journal.snapshot())
    hashes = page_hashes(_FAMILIES[0], PAGE, salt=SALT)
    assert index.hits("r", hashes) == Hits(device=4, host=2)
    assert index.hits("r", page_hashes(_FAMILIES[1], PAGE, salt=SALT)) == Hits()
    assert index.hits("other", hashes) == Hits() and index.size == 6
    assert index.held("r") == 6 and index.held("other") == 0  # L1 or L2, each page once


def test_the_records_are_vllm_kv_events() -> None:
    replica = _Replica()
    replica.run("insert", (0, 2))
    replica.run("insert", (0, 3))
    replica.tree.evict_device(1)
    replica.journal.flush()
    published = replica.journal.since(0)
    assert published is not None
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(published[0]), type=EventBatch).batch
    cleared, first, second, removed = batch.events
    hashes = page_hashes(_FAMILIES[0][: 3 * PAGE], PAGE, salt=SALT)
    assert isinstance(cleared, AllBlocksCleared)
    assert first == BlockStored(hashes[:2], None, [], PAGE, medium="GPU")
    assert second == BlockStored(hashes[2:], hashes[1], [], PAGE, medium="GPU")
    assert removed == BlockRemoved(hashes[2:], medium="GPU")
    wire = msgspec.msgpack.encode(batch)  # tagged arrays, as vLLM's subscribers decode them
    raw = msgspec.msgpack.decode(wire)
    assert raw[1][1][0] == "BlockStored" and raw[1][3][0] == "BlockRemoved"
    assert msgspec.msgpack.decode(wire, type=KVEventBatch) == batch


def test_a_bad_subscriber_position_is_refused() -> None:
    assert check_position("e", 0) == ("e", 0)
    for epoch, seq, error in (
        (None, 0, TypeError),
        ("e", "1", TypeError),
        ("e", True, TypeError),
        ("e", 1.0, TypeError),
        ("e", -1, ValueError),
    ):
        with pytest.raises(error):
            check_position(epoch, seq)


def test_the_index_knows_how_old_each_replicas_news_is() -> None:
    tree = HiRadixTree(PAGE)
    journal = CacheEvents(tree, clock=lambda: 100.0)
    tree.observer = journal
    index = CacheIndex()
    index.reset("r", journal.snapshot())
    assert index.lag_s("r", 103.5) == 3.5 and index.lag_s("other", 103.5) == 0.0
