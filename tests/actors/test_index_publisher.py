"""A replica's publisher sends to an index only a router made, and until one exists looks
for it once a second, not every 20 ms."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from actors import index_actor
from actors.index_actor import FIND_EVERY_S, PUBLISH_EVERY_S, Publisher
from hicache_ray.cache.events import EventBatch, KVEventBatch


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
    def cache_events(self, epoch: str, seq: int, wait_s: float = 0.0) -> list[Any] | None:
        return None  # a new subscriber: the snapshot

    def cache_snapshot(self) -> Any:
        return EventBatch("e", 0, KVEventBatch(0.0, []))


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


class _Journal:
    """A replica's journal: batches ``e``/1..``last``; records what it was asked."""

    def __init__(self) -> None:
        self.last, self.asked = 2, []

    def cache_events(self, epoch: str, seq: int, wait_s: float = 0.0) -> list[Any] | None:
        self.asked.append((epoch, seq, wait_s))
        if epoch != "e":
            return None
        return [EventBatch("e", n, KVEventBatch(0.0, [])) for n in range(seq + 1, self.last + 1)]

    def cache_snapshot(self) -> Any:
        return EventBatch("e", self.last, KVEventBatch(0.0, []))


class _Recorder:
    """An index actor's handle: ``position`` answers ``where``; ``apply`` answers ``ok``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.where, self.ok = ("", 0), True

    def __getattr__(self, method: str) -> Any:
        outer = self

        class _Method:
            def remote(self, *args: Any) -> Any:
                outer.calls.append(method)
                return {"position": outer.where, "apply": outer.ok}.get(method)

        return _Method()


def test_a_publisher_sends_only_what_is_new_and_asks_its_position_once_a_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actors.index_actor import HEARTBEAT_S, POLL_S

    now = [50.0]
    index, journal = _Recorder(), _Journal()
    monkeypatch.setattr(index_actor, "find_index", lambda app: index)
    monkeypatch.setattr("actors.index_actor.ray.get", lambda ref, timeout=None: ref)
    monkeypatch.setattr("actors.index_actor.time.monotonic", lambda: now[0])
    publisher = Publisher(journal, "app", "replica-a")

    def rounds(n: int) -> list[str]:
        index.calls.clear()
        for _ in range(n):
            assert publisher._publish() == PUBLISH_EVERY_S
        return index.calls

    assert rounds(1) == ["position", "reset"]  # unknown there: the snapshot
    assert journal.asked[-1] == ("", 0, POLL_S)  # a long poll on the journal
    assert rounds(3) == []  # nothing new: no call at all
    assert journal.asked[-3:] == [("e", 2, POLL_S)] * 3
    journal.last = 4
    assert rounds(2) == ["apply"]  # batches 3 and 4, once
    assert journal.asked[-1] == ("e", 4, POLL_S)
    now[0] += HEARTBEAT_S
    index.where = ("e", 4)
    assert rounds(2) == ["position"]  # the heartbeat, once a second
    journal.last, index.ok = 5, False  # the index has lost track: it is forgotten there
    assert rounds(1) == ["apply", "remove"]
    index.where = ("", 0)
    assert rounds(1) == ["position", "reset"]  # asked again at once: the snapshot


class _DyingJournal(_Journal):
    """A deployment's journal whose rank 0 dies: ``cache_events`` raises Ray's actor-died
    error ``dead`` times, then answers as the re-formed ranks' new journal."""

    def __init__(self, dead: int) -> None:
        super().__init__()
        self.dead = dead

    def cache_events(self, epoch: str, seq: int, wait_s: float = 0.0) -> list[Any] | None:
        if self.dead:
            self.dead -= 1
            raise ray.exceptions.ActorDiedError()
        return super().cache_events(epoch, seq, wait_s)


def test_a_replica_whose_rank_0_dies_is_forgotten_by_the_index_once_until_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its L1 and L2 died with the ranks: the index has it down at the first failure
    (not when the re-formed ranks' snapshot arrives), tells nothing more while the ranks
    stay gone, and takes the new snapshot once they answer; a second death is told too."""
    index, journal = _Recorder(), _DyingJournal(dead=0)
    monkeypatch.setattr(index_actor, "find_index", lambda app: index)
    monkeypatch.setattr("actors.index_actor.ray.get", lambda ref, timeout=None: ref)
    publisher = Publisher(journal, "app", "replica-a")
    publisher._publish()
    index.where = ("e", 2)

    def rounds(n: int) -> list[str]:
        index.calls.clear()
        publisher._halt = _Halt(rounds=n)  # type: ignore[assignment]
        publisher.run()
        return index.calls

    journal.dead = 3
    assert rounds(3) == ["reset", "position", "position"]  # down; then asked where it stands
    index.where = ("", 0)  # forgotten there
    assert rounds(1) == ["position", "reset"]  # the re-formed ranks' snapshot
    journal.dead = 1
    assert rounds(1) == ["reset"]  # dead again: told again


def test_a_publisher_whose_index_dies_finds_it_again_and_forgets_no_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The actor that died is the index (its maker went), not the replica's rank 0: the
    replica's pages are not removed, and the next round looks for the index again."""

    class _IndexDied(ray.exceptions.ActorDiedError):
        def __str__(self) -> str:
            return "The actor died unexpectedly: class_name: IndexActor"

    class _Sent(_Journal):
        def cache_events(self, epoch: str, seq: int, wait_s: float = 0.0) -> list[Any] | None:
            raise _IndexDied()  # as the index's answer to what was sent would

    index = _Recorder()
    monkeypatch.setattr(index_actor, "find_index", lambda app: index)
    monkeypatch.setattr("actors.index_actor.ray.get", lambda ref, timeout=None: ref)
    publisher = Publisher(_Sent(), "app", "replica-a")
    publisher._halt = _Halt(rounds=1)  # type: ignore[assignment]
    publisher.run()
    assert index.calls == ["position"]  # and not marked down
    assert publisher._index is None
