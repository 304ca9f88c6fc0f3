"""Multi-turn traces and the LRU oracle (no Ray)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.multiturn.oracle import OracleRequest, lru_hit_tokens
from apps.multiturn.trace import Lengths, Trace, TraceConfig
from hicache_ray.base.errors import ConfigError


def test_lengths_parse_and_refuse() -> None:
    assert Lengths.parse("64", "user") == Lengths(64)
    assert Lengths.parse("8-16", "user") == Lengths(8, 16)
    for bad in ("x", "9-3", "-1"):
        with pytest.raises(ConfigError, match="user"):
            Lengths.parse(bad, "user")


def test_a_trace_is_the_same_every_time_and_grows_by_answers() -> None:
    config = TraceConfig(clients=2, rounds=2, system_len=5, user=Lengths(3, 6), answer=Lengths(2))
    a, b = Trace(config), Trace(config)
    assert a.prompts(0) == b.prompts(0)
    first = a.prompts(0)
    assert all(p[:5] == first[0][0][:5] and n == 2 for p, n in first)  # shared system prompt
    a.record(0, [[7, 8], [9, 10]])
    second = a.prompts(1)
    assert second[0][0][: len(first[0][0]) + 2] == first[0][0] + [7, 8]


def test_oracle_counts_leading_pages_and_evicts_lru() -> None:
    page = 2
    a = OracleRequest([1, 2, 3, 4, 5], [6, 7])  # inserts 1..6: pages (1,2) (3,4) (5,6)
    again = OracleRequest([1, 2, 3, 4, 5, 6, 9], [1])
    other = OracleRequest([8, 8, 8, 8, 8], [1, 1])
    assert lru_hit_tokens([[a], [again]], page, None) == [[0], [6]]
    assert lru_hit_tokens([[a], [again]], page, 0) == [[0], [0]]
    # three pages fit; `other` evicts a's pages
    assert lru_hit_tokens([[a], [other], [again]], page, 3) == [[0], [0], [0]]
    # a request admitted in the same wave does not see the other's inserts
    assert lru_hit_tokens([[a, again]], page, None) == [[0, 0]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12),
    st.integers(0, 8),
)
def test_a_larger_lru_never_hits_less(prompts: list[list[int]], capacity: int) -> None:
    waves = [[OracleRequest(p, [0, 1])] for p in prompts]
    small = lru_hit_tokens(waves, 2, capacity)
    large = lru_hit_tokens(waves, 2, capacity + 3)
    infinite = lru_hit_tokens(waves, 2, None)
    for s, big, inf in zip(small, large, infinite, strict=True):
        assert s[0] <= big[0] <= inf[0]


def test_the_oracle_evicts_leaves_only() -> None:
    """Evicting a page under a cached one would strand the latter: only leaves go."""
    a = OracleRequest([1, 2, 3, 4, 5], [9])  # pages [1, 2], [3, 4]
    b = OracleRequest([7, 8, 7], [9])  # page [7, 8]
    c = OracleRequest([11, 12, 13, 14, 15], [9])
    # after a's second turn the LRU order is b1, a1, a2; c needs room for two pages: b1
    # goes, a1 is skipped (a2 extends it), a2 goes: a keeps its first page
    assert lru_hit_tokens([[a], [b], [a], [c], [a]], 2, 3) == [[0], [0], [4], [0], [2]]
