"""Where a prefetch query found its pages, kept for its reads (no Ray needed)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from actors.located import Located


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_read_takes_what_the_lookup_found_once() -> None:
    located = Located(ttl_s=2.0, clock=Clock())
    # refs a, b; keys k0 (a, item 0), k1 absent, k2 (b, item 4), k3 known but sizeless
    located.remember(
        ["k0", "k1", "k2", "k3"], ["a", "b"], [(0, 0), None, (1, 4), (0, 2)], [10, None, 12, None]
    )
    known, (refs, places) = located.take(["k2", "k1", "k0", "k9"])
    assert known == [0, 2]
    assert [(refs[r], item) for r, item in places] == [("b", 4), ("a", 0)]
    assert located.take(["k0", "k2"]) == ([], ([], []))  # taken: the next read asks again
    assert len(located) == 0


def test_references_expire_and_removed_keys_are_forgotten() -> None:
    clock = Clock()
    located = Located(ttl_s=2.0, clock=clock)
    located.remember(["old"], ["a"], [(0, 0)], [1])
    clock.now += 1.5
    located.remember(["new", "gone"], ["b"], [(0, 0), (0, 2)], [1, 1])
    located.forget(["gone"])
    clock.now += 1.0  # "old" is 2.5 s old, "new" 1.0 s
    assert located.take(["old", "new", "gone"])[0] == [1]
    assert len(located) == 0  # the expired one was dropped, not only skipped


@given(st.lists(st.integers(0, 30), max_size=80), st.integers(1, 8))
def test_at_most_max_keys_are_kept_the_newest_first(keys: list[int], most: int) -> None:
    located = Located(ttl_s=60.0, max_keys=most, clock=Clock())
    for k in keys:
        located.remember([str(k)], ["ref"], [(0, 0)], [1])
        assert len(located) <= most
    newest = list(dict.fromkeys(reversed([str(k) for k in keys])))[:most]
    known, _ = located.take(newest)
    assert known == list(range(len(newest)))
