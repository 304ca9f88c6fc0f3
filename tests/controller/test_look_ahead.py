"""A prompt about to be admitted is looked up in L3 ahead (``Claims.look_ahead``): the query
at admission then asks nothing (neither the store nor its client's cache), and reads the
same pages. Skipped where it cannot pay; a stale answer is not trusted."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from hicache_ray.base.tokens import encode_tokens
from hicache_ray.cache.controller import Arrival
from hicache_ray.cache.controller import prefetch as prefetch_module
from hicache_ray.cache.controller.fetch_task import FetchTask
from hicache_ray.storage import MemoryObjects
from hicache_ray.storage.objects import SizeOutcome
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    controller_config,
    drain,
    make_controller,
    prompt,
    run_request,
    stored,
)

KV = make_kv(page_size=PAGE)


class _Counted(MemoryObjects):
    """A memory store that counts its lookups (``size_many`` calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0

    def size_many(self, keys: Sequence[str], leading: bool = True) -> list[SizeOutcome]:
        self.lookups += 1
        return super().size_many(keys, leading)


def _reader(stored_tokens: list[int]) -> tuple[Any, _Counted, list[FetchTask]]:
    """A reader over a store holding ``stored_tokens``; the look-ahead tasks it queues."""
    objects = _Counted()
    stored(objects, stored_tokens)
    reader = make_controller(controller_config(), KV, objects)
    assert reader.prefetch is not None
    queued: list[FetchTask] = []
    look_ahead = reader.prefetch.look_ahead

    def counted(task: FetchTask, *, here: bool = False) -> None:
        queued.append(task)
        look_ahead(task, here=here)

    reader.prefetch.look_ahead = counted
    return reader, objects, queued


def test_the_query_at_admission_asks_the_store_nothing_after_a_look_ahead() -> None:
    tokens = prompt(61, 40)
    reader, objects, queued = _reader(tokens[:32])  # 8 of the 10 pages stored
    assert reader.claims.look_ahead(encode_tokens(tokens), "") == 0
    assert len(queued) == 1 and queued[0].queried.wait(30)
    assert queued[0].local_total == 8 and reader.stats().prefetch_lookaheads == 1
    asked, storage = objects.lookups, reader.prefetch.query._storage
    exists, queries = storage.exists, []

    def counted(keys: Sequence[str]) -> int:
        queries.append(threading.current_thread().name)
        return exists(keys)

    storage.exists = counted
    cached, _ = run_request(reader, "r", tokens)
    assert cached == 8  # every stored page, read from L3
    assert objects.lookups == asked  # nor the absent 9th page asked about again
    assert "hicache-prefetch-query" not in queries  # nor the store client's cache
    assert reader.stats().prefetched_pages == 8
    drain(reader)
    reader.check_integrity()
    reader.close()


def test_without_a_fresh_look_ahead_the_query_asks_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefetch_module, "AHEAD_TRUST_S", -1.0)  # every answer is stale
    tokens = prompt(62, 40)
    reader, objects, queued = _reader(tokens[:32])
    assert reader.claims.look_ahead(encode_tokens(tokens), "") == 0 and queued[0].queried.wait(30)
    asked = objects.lookups
    cached, _ = run_request(reader, "r", tokens)
    assert cached == 8 and objects.lookups > asked  # the 9th page was asked about again
    drain(reader)
    reader.close()


def test_a_look_ahead_is_skipped_where_it_cannot_pay() -> None:
    tokens = prompt(63, 40)
    reader, _, queued = _reader(tokens[:32])
    run_request(reader, "warm", tokens)  # now every page is held here
    drain(reader)
    assert (
        reader.claims.look_ahead(encode_tokens(tokens), "") == -1
    )  # cached here: nothing to look up
    assert reader.claims.look_ahead(encode_tokens(tokens[:3]), "") == -1  # not a whole page
    other = prompt(64, 40)
    reader.step([Arrival("held", other)])  # a prefetch pending here
    assert reader.claims.num_fetching == 1
    assert reader.claims.look_ahead(encode_tokens(prompt(65, 40)), "") == -1
    assert queued == [] and reader.stats().prefetch_lookaheads == 0
    reader.cancel("held")
    drain(reader)
    reader.close()


def test_a_look_ahead_from_a_later_page_than_the_query_is_not_trusted() -> None:
    tokens = prompt(66, 40)
    reader, objects, queued = _reader(tokens[:32])
    assert reader.claims.look_ahead_from(
        encode_tokens(tokens), "", 4
    )  # as if 4 pages were held here
    assert queued[0].queried.wait(30) and queued[0].local_total == 8
    asked = objects.lookups
    cached, _ = run_request(reader, "r", tokens)  # it holds none: asks from page 0
    assert cached == 8 and objects.lookups > asked
    drain(reader)
    reader.close()


def test_a_look_ahead_run_on_another_thread_answers_the_query_that_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer's hint thread runs its look-ahead itself (``here``); the query of the same
    prompt, on the query thread meanwhile, waits for that answer and asks nothing."""
    waiting, inside, gate = threading.Event(), threading.Event(), threading.Event()

    class _Noting(threading.Event):  # the query thread's wait for the running look-ahead
        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            return super().wait(timeout)

    monkeypatch.setattr(
        prefetch_module, "threading", SimpleNamespace(Lock=threading.Lock, Event=_Noting)
    )
    tokens = prompt(67, 40)
    reader, objects, queued = _reader(tokens[:32])
    storage = reader.prefetch.query._storage
    exists = storage.exists

    def held(keys: Sequence[str]) -> int:  # the look-ahead's lookup, held until the query waits
        inside.set()
        assert gate.wait(30)
        return exists(keys)

    storage.exists = held
    key = encode_tokens(tokens)
    hint = threading.Thread(
        target=lambda: reader.claims.look_ahead_from(key, "", 0, here=True), name="hint"
    )
    hint.start()
    assert inside.wait(30)
    storage.exists = exists
    query = FetchTask(key, len(tokens) // PAGE, 0, reader.config.storage.tenant_salt)
    reader.prefetch.query.inbox.put(query)
    assert waiting.wait(30)  # the query waits for the look-ahead's answer...
    asked = objects.lookups
    gate.set()
    hint.join(30)
    assert query.queried.wait(30) and query.local_total == 8
    assert objects.lookups == asked + 1  # ...and asks nothing itself
    assert len(queued) == 1 and queued[0].local_total == 8
    reader.close()
