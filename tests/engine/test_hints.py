"""Rank 0's look-ahead of its arrivals (:class:`LookAhead`) and the check of the hints its
peers receive (:func:`hint_problem`): a hint is a guess, and never fails a request."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hicache_ray.base.tokens import encode_tokens
from hicache_ray.engine.hints import MAX_SALT_CHARS, LookAhead, hint_problem


@dataclass
class _Request:
    rid: str
    tokens: list[int]
    cache_salt: str = ""


def test_rank_0_looks_each_arrival_up_and_tells_the_peers_which_step_admits_it() -> None:
    looked: list[tuple[bytes, str]] = []
    told: list[tuple[bytes, str, int, int]] = []

    def look(key: bytes, salt: str) -> int:
        looked.append((key, salt))
        return -1 if salt == "cached" else 2

    ahead = LookAhead(look, lambda: 41)
    assert ahead.arrivals([_Request("a", [1, 2, 3])]) == 1  # no peers to tell
    ahead.tell = lambda *hint: told.append(hint)
    requests = [_Request("b", [4, 5], "t"), _Request("c", [6], "cached")]
    assert ahead.arrivals(requests) == 1
    assert [salt for _, salt in looked] == ["", "t", "cached"]
    assert told == [(encode_tokens([4, 5]), "t", 2, 42)]  # not the one cached here


def test_a_look_ahead_that_fails_skips_that_request_alone() -> None:
    def look(key: bytes, salt: str) -> int:
        if salt == "bad":
            raise OSError("store closed")
        return 0

    told: list[object] = []
    ahead = LookAhead(look, lambda: 0)
    ahead.tell = lambda *hint: told.append(hint[0])
    requests = [_Request("a", [1], "bad"), _Request("b", [2**32]), _Request("c", [3])]
    assert ahead.arrivals(requests) == 1  # b's token cannot be encoded: no hint either
    assert told == [encode_tokens([3])]


@pytest.mark.parametrize(
    ("hint", "problem"),
    [
        (("x", "", 0, 1), "encoded tokens"),
        ((b"", "", 0, 1), "encoded tokens"),
        ((b"abc", "", 0, 1), "encoded tokens"),
        ((b"abcd", 7, 0, 1), "cache salt"),
        ((b"abcd", "s" * (MAX_SALT_CHARS + 1), 0, 1), "cache salt"),
        ((b"abcd", "", 2, 1), "first page"),
        ((b"abcd", "", True, 1), "first page"),
        ((b"abcd", "", 0, -1), "admitting step"),
        ((b"abcd", "", 0, 1.0), "admitting step"),
    ],
)
def test_a_malformed_hint_is_named(hint: tuple[object, ...], problem: str) -> None:
    found = hint_problem(*hint)
    assert found is not None and problem in found


def test_a_good_hint_has_no_problem() -> None:
    assert hint_problem(encode_tokens([1, 2, 3]), "tenant", 3, 0) is None
