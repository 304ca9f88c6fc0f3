"""The sibling hold's parts: shared pages of two prompts, the decision, and the tree look
that changes nothing (``engine/hold.py``, ``cache/tree/peek.py``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_ray.cache.tree import HiRadixTree
from hicache_ray.cache.tree.peek import cached_pages
from hicache_ray.engine.hold import SiblingHold, shared_pages
from hicache_ray.engine.request import GenerateRequest

PAGE = 4
_tokens = st.lists(st.integers(1, 3), max_size=40)  # a small alphabet: long shared runs


@given(_tokens, _tokens)
def test_shared_pages_are_the_leading_whole_pages_in_common(a: list[int], b: list[int]) -> None:
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    assert shared_pages(a, b, PAGE) == same // PAGE


def _request(tokens: list[int], salt: str = "") -> GenerateRequest:
    return GenerateRequest("r", tokens, 1, cache_salt=salt)


def test_a_request_waits_only_for_pages_neither_it_nor_the_one_ahead_has() -> None:
    cached = {"n": 0}
    hold = SiblingHold(PAGE, lambda r: cached["n"])
    base = list(range(1, 21))  # 5 pages
    mine = _request([*base, 99])
    ahead = _request([*base[:12], 7, 7, 7, 7])  # shares 3 pages
    assert hold.held(mine, [(ahead, 0)])
    assert hold.held(mine, [(ahead, 2)])  # it has 2 of the 3
    assert not hold.held(mine, [(ahead, 3)])  # it has them all
    cached["n"] = 3
    assert not hold.held(mine, [(ahead, 0)])  # this rank's cache holds them
    assert not hold.held(mine, [(_request(ahead.tokens, salt="t"), 0)])  # another tenant
    assert not hold.held(mine, [(_request([5, 5, 5, 5, 5]), 0)])  # nothing shared
    assert not hold.held(mine, [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_tokens, st.booleans()), max_size=6), _tokens)
def test_the_tree_look_counts_what_a_match_counts_and_changes_nothing(
    inserts: list[tuple[list[int], bool]], query: list[int]
) -> None:
    tree = HiRadixTree(PAGE)
    page = 0
    for tokens, to_host in inserts:
        m = tree.match_prefix(tokens)
        held = len(m.device_pages) + m.host_hit_pages
        new = list(range(page, page + len(tokens) // PAGE - held))
        page += len(new)
        if new and to_host:
            tree.insert_host(tokens, held, new)
        elif new and m.host_hit_pages == 0:
            tree.insert(tokens, [*m.device_pages, *new])
    before = [(n.id, n.key, n.last_access, n.hit_count) for n in tree.nodes()]
    found = cached_pages(tree, query)
    assert [(n.id, n.key, n.last_access, n.hit_count) for n in tree.nodes()] == before
    m = tree.match_prefix(query, count_hit=False)
    assert found == len(m.device_pages) + m.host_hit_pages
