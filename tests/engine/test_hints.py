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


def test_rank_0_tells_the_peers_which_step_admits_each_arrival_then_looks_it_up() -> None:
    events: list[tuple[object, ...]] = []

    class Lookups:
        def look_ahead_start(self, key: bytes, salt: str) -> int:
            return -1 if salt == "cached" else 2

        def look_ahead_from(self, key: bytes, salt: str, first: int) -> bool:
            events.append(("look", key, salt, first))
            return salt != "full"  # a lookup not queued after all (a pending prefetch)

    ahead = LookAhead(Lookups(), lambda: 41)
    assert ahead.arrivals([_Request("a", [1, 2, 3])]) == 1  # no peers to tell
    ahead.tell = lambda *hint: events.append(("tell", *hint))
    events.clear()
    requests = [_Request("b", [4, 5], "t"), _Request("c", [6], "cached")]
    requests.append(_Request("d", [7], "full"))
    assert ahead.arrivals(requests) == 1
    b, d = encode_tokens([4, 5]), encode_tokens([7])
    assert events == [  # each peer first; nothing for the one cached here
        ("tell", b, "t", 2, 42),
        ("look", b, "t", 2),
        ("tell", d, "full", 2, 42),
        ("look", d, "full", 2),
    ]


def test_a_look_ahead_that_fails_skips_that_request_alone() -> None:
    class Lookups:
        def look_ahead_start(self, key: bytes, salt: str) -> int:
            return 0

        def look_ahead_from(self, key: bytes, salt: str, first: int) -> bool:
            if salt == "bad":
                raise OSError("store closed")
            return True

    told: list[object] = []
    ahead = LookAhead(Lookups(), lambda: 0)
    ahead.tell = lambda *hint: told.append(hint[0])
    requests = [_Request("a", [1], "bad"), _Request("b", [2**32]), _Request("c", [3])]
    assert ahead.arrivals(requests) == 1  # b's token cannot be encoded: no hint either
    assert told == [encode_tokens([1]), encode_tokens([3])]  # a's peers were told first


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
