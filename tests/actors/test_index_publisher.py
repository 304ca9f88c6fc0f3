"""A replica's publisher sends to an index only a router made, and until one exists looks
for it once a second, not every 20 ms."""

from __future__ import annotations

from typing import Any

import pytest

from actors import index_actor
from actors.index_actor import FIND_EVERY_S, PUBLISH_EVERY_S, Publisher


class _Halt:
    """The publisher's stop event: records each wait, stops after ``rounds``."""

    def __init__(self, rounds: int) -> None:
        self.waits: list[float] = []
        self._rounds = rounds

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return len(self.waits) > self._rounds

    def set(self) -> None:
        pass


class _Index:
    """An index actor's handle: answers ``position``; counts what was sent."""

    def __init__(self) -> None:
        self.sent = 0

    def __getattr__(self, method: str) -> Any:
        outer = self

        class _Method:
            def remote(self, *args: Any) -> Any:
                outer.sent += method != "position"
                return ("", 0) if method == "position" else True

        return _Method()


class _Source:
    def cache_events(self, epoch: str, seq: int) -> list[Any] | None:
        return None  # a new subscriber: the snapshot

    def cache_snapshot(self) -> Any:
        return "snapshot"


def test_a_publisher_looks_for_the_index_slowly_and_never_makes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found: list[Any] = [None, None, _Index()]  # made by a router after two lookups
    lookups: list[str] = []

    def find(app: str) -> Any:
        lookups.append(app)
        return found[min(len(lookups), len(found)) - 1]

    monkeypatch.setattr(index_actor, "find_index", find)
    monkeypatch.setattr(index_actor, "index_actor", lambda app: pytest.fail("made here"))
    monkeypatch.setattr("actors.index_actor.ray.get", lambda ref, timeout=None: ref)
    publisher = Publisher(_Source(), "app", "replica-a")
    halt = _Halt(rounds=5)
    publisher._halt = halt  # type: ignore[assignment]
    publisher.run()
    assert lookups == ["app", "app", "app"]  # then it kept the one found
    # the first wait is the publishing pace; after each miss, the slow one; then the pace
    assert halt.waits == [PUBLISH_EVERY_S, FIND_EVERY_S, FIND_EVERY_S] + [PUBLISH_EVERY_S] * 3
    assert found[2].sent == 3  # a snapshot each round once found (the fake never advances)
