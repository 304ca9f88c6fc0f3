from __future__ import annotations

import pytest

from hicache_ray.base.tokens import decode_tokens, encode_tokens
from hicache_ray.cache.tree import HiRadixTree
from hicache_ray.cache.tree.node_hashes import node_page_hashes
from hicache_ray.keys.page_hash import page_hashes

P = 2  # page size: small so splits are easy to write down


def toks(*ids: int) -> list[int]:
    return list(ids)


def test_tokens_encode_all_forms_and_refuse_bad_ids() -> None:
    import numpy as np
    import torch

    key = encode_tokens([1, 2, 70000])
    assert key == (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + (70000).to_bytes(
        4, "little"
    )
    assert encode_tokens(np.array([1, 2, 70000])) == key
    assert encode_tokens(torch.tensor([1, 2, 70000])) == key
    assert encode_tokens(key) == key and decode_tokens(key) == [1, 2, 70000]
    for bad in ([-1], [2**32], np.array([-3])):
        with pytest.raises(ValueError, match="2\\*\\*32"):
            encode_tokens(bad)
    with pytest.raises(ValueError, match="multiple of 4"):
        encode_tokens(b"abc")


def test_match_insert_split_and_partial_pages() -> None:
    t = HiRadixTree(P)
    r = t.insert(toks(1, 2, 3, 4, 5, 6), [10, 11, 12])
    assert len(r.new_nodes) == 1 and not r.duplicate_pages
    m = t.match_prefix(toks(1, 2, 3, 4, 9, 9, 7))
    assert m.device_pages == [10, 11] and m.host_hit_pages == 0
    assert t.num_nodes == 2  # split at the page boundary
    # a partial last page never matches
    assert t.match_prefix(toks(1, 2, 3)).device_pages == [10]
    r = t.insert(toks(1, 2, 3, 4, 7, 8), [20, 21, 22])
    assert r.duplicate_pages == [20, 21] and [n.device_pages for n in r.new_nodes] == [[22]]
    with pytest.raises(ValueError, match="need 4 tokens"):
        t.insert(toks(1, 2, 3), [1, 2])
    t.check_integrity()


def test_device_eviction_is_lru_over_unlocked_leaves() -> None:
    t = HiRadixTree(P)
    t.insert(toks(1, 1, 2, 2), [0, 1])
    t.insert(toks(1, 1, 3, 3), [0, 2])
    t.insert(toks(4, 4), [3])
    t.match_prefix(toks(1, 1, 2, 2))  # most recent
    locked = t.match_prefix(toks(4, 4)).last_device_node
    t.lock(locked)
    assert t.evict_device(1) == [2]  # (1,1,3,3) leaf is the LRU unlocked leaf
    assert sorted(t.evict_device(10)) == [0, 1]  # leaf, then its parent; (4,4) is locked
    t.unlock(locked)
    assert t.evict_device(10) == [3]
    assert t.num_nodes == 0 and t.num_device_pages == 0
    with pytest.raises(RuntimeError, match="not locked"):
        t.unlock(locked)
    t.check_integrity()


def test_backed_up_nodes_become_host_only_and_host_eviction_follows() -> None:
    t = HiRadixTree(P)
    r = t.insert(toks(1, 1, 2, 2), [0, 1])
    node = r.new_nodes[0]
    t.set_host(node, [7, 8], pending=None)
    assert node.backed_up
    assert sorted(t.evict_device(2)) == [0, 1]
    m = t.match_prefix(toks(1, 1, 2, 2, 3, 3))
    assert m.device_pages == [] and m.host_hit_pages == 2 and m.best_match_node is node
    assert m.last_device_node is t.root and m.last_host_node is node
    t.check_integrity()
    assert t.evict_host(1) == [7, 8] and t.num_nodes == 0
    t.check_integrity()


def test_insert_adopts_pages_for_host_only_nodes() -> None:
    t = HiRadixTree(P)
    node = t.insert(toks(5, 5), [0]).new_nodes[0]
    t.set_host(node, [3], pending=None)
    t.evict_device(1)
    r = t.insert(toks(5, 5, 6, 6), [4, 9])
    assert r.adopted_nodes == [node] and node.device_pages == [4]
    t.check_integrity()


def test_dead_branches_stop_the_walk() -> None:
    t = HiRadixTree(P)
    t.insert(toks(1, 1, 2, 2), [0, 1])
    parent = t.match_prefix(toks(1, 1)).last_device_node
    child = next(iter(parent.children.values()))
    t.set_host(child, [5], pending=None)
    assert t.evict_device(1) == [1]  # child becomes host-only
    assert t.evict_device(1) == [0]  # parent had no host copy: it is now dead
    assert parent.dead and parent.children
    m = t.match_prefix(toks(1, 1, 2, 2))
    assert m.best_match_node is t.root and m.host_hit_pages == 0
    t.check_integrity()
    assert t.evict_host(1) == [5]  # the orphan goes, and the dead parent with it
    assert t.num_nodes == 0
    t.check_integrity()


def test_split_keeps_locks_and_pending_copies_on_both_halves() -> None:
    class Done:
        done = True
        ok = True

    t = HiRadixTree(P)
    node = t.insert(toks(1, 1, 2, 2), [0, 1]).new_nodes[0]
    pending = Done()
    t.set_host(node, [4, 5], pending=pending)
    t.lock(node)
    t.match_prefix(toks(1, 1, 9, 9))  # splits
    top = t.match_prefix(toks(1, 1)).last_device_node
    assert top is not node and top.lock_ref == 1 and top.host_pending is pending
    assert top.host_pages == [4] and node.host_pages == [5]
    t.unlock(node)
    assert top.lock_ref == 0
    t.check_integrity()


def test_a_host_only_lock_pins_the_host_copy_not_the_device_pages() -> None:
    t = HiRadixTree(P)
    node = t.insert(toks(1, 1, 2, 2), [0, 1]).new_nodes[0]
    t.set_host(node, [4, 5], pending=None)
    t.lock(node, host_only=True)  # a backup reads the host copy
    t.match_prefix(toks(1, 1, 9, 9))  # splits: both halves keep the lock
    t.check_integrity()
    assert sorted(t.evict_device(2)) == [0, 1]  # the device pages may go
    assert t.evict_host(2) == []  # the host copy may not
    with pytest.raises(RuntimeError, match="not locked"):
        t.unlock(node)  # a host-only lock is not a full one
    t.unlock(node, host_only=True)
    assert sorted(t.evict_host(2)) == [4, 5]
    assert t.num_nodes == 0
    t.check_integrity()


def test_write_back_hook_sees_unwritten_victims() -> None:
    t = HiRadixTree(P)
    node = t.insert(toks(1, 1), [0]).new_nodes[0]
    seen = []

    def write_back(nodes: list) -> None:  # type: ignore[type-arg]
        seen.extend(nodes)
        for n in nodes:
            t.set_host(n, [9], pending=None)

    assert t.evict_device(1, write_back) == [0]
    assert seen == [node] and node.host_pages == [9] and not node.dead
    t.check_integrity()


def test_guards_on_state_changes() -> None:
    t = HiRadixTree(P)
    node = t.insert(toks(1, 1, 2, 2), [0, 1]).new_nodes[0]
    with pytest.raises(RuntimeError, match="already on the device"):
        t.set_device(node, [3, 4], None)
    with pytest.raises(ValueError, match="host pages"):
        t.set_host(node, [1], None)
    t.set_host(node, [1, 2], None)
    with pytest.raises(RuntimeError, match="already has a host copy"):
        t.set_host(node, [1, 2], None)
    assert t.clear_host(node) == [1, 2]
    t.check_integrity()


def test_insert_host_adds_refills_under_the_prefix_and_reports_duplicates() -> None:
    tree = HiRadixTree(P)
    tokens = list(range(8 * P))
    tree.insert(tokens, [0, 1])  # pages 0-1 on device
    result = tree.insert_host(tokens, 2, [10, 11, 12])  # pages 2-4 from storage
    assert [n.host_pages for n in result.new_nodes] == [[10, 11, 12]]
    m = tree.match_prefix(tokens)
    assert m.device_pages == [0, 1] and m.host_hit_pages == 3
    # Again, overlapping: pages 2-4 are duplicates, page 5 is new.
    again = tree.insert_host(tokens, 2, [20, 21, 22, 23])
    assert again.duplicate_pages == [20, 21, 22] and again.new_nodes[0].host_pages == [23]
    # A device-only node adopts host pages; a prefix not in the tree is refused.
    other = [7] * (4 * P)
    tree.insert(other, [5, 6, 7])
    adopt = tree.insert_host(other, 1, [30, 31])
    assert adopt.duplicate_pages == [] and [n.host_pages for n in adopt.adopted_nodes] == [[30, 31]]
    with pytest.raises(ValueError, match="not in the tree"):
        tree.insert_host([9] * (4 * P), 1, [40])
    tree.check_integrity()


def test_each_salt_has_its_own_root_and_names_its_pages_with_it() -> None:
    t = HiRadixTree(P, "deployment")
    t.insert(toks(1, 1, 2, 2), [0, 1])
    t.insert(toks(1, 1, 2, 2), [2, 3], salt="alice")
    assert t.match_prefix(toks(1, 1, 2, 2), salt="bob").device_pages == []
    assert t.match_prefix(toks(1, 1, 2, 2), salt="alice").device_pages == [2, 3]
    assert t.match_prefix(toks(1, 1, 2, 2), salt="deployment").device_pages == [0, 1]
    assert len(t.roots) == 1  # bob's match created no root
    mine = t.match_prefix(toks(1, 1, 2, 2), salt="alice").last_device_node
    ours = t.match_prefix(toks(1, 1, 2, 2)).last_device_node
    names = t.roots.salt_of
    assert node_page_hashes(mine, P, names) == page_hashes(toks(1, 1, 2, 2), P, salt="alice")
    assert node_page_hashes(ours, P, names) == page_hashes(toks(1, 1, 2, 2), P, salt="deployment")
    t.check_integrity()
    assert sorted(t.evict_device(10)) == [0, 1, 2, 3]  # one LRU over both roots
    assert len(t.roots) == 0  # alice's emptied root is gone
    t.check_integrity()
