"""Backups wait while an L3 hit is being read (until every rank has read it), unless their
backlog is large."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from hicache_ray.base.tokens import encode_tokens
from hicache_ray.cache.controller import Arrival
from hicache_ray.cache.controller.backup import BackupPipeline, BackupTask
from hicache_ray.cache.controller.fetch_task import FetchTask
from hicache_ray.cache.controller.prefetch import PrefetchPipeline
from hicache_ray.cache.controller.reads_first import ReadsFirst
from hicache_ray.cache.memory import HostPool
from hicache_ray.cache.tree import TreeNode
from hicache_ray.keys import page_hashes, plan_shard
from hicache_ray.storage import MemoryObjects
from hicache_ray.storage.objects import ReadOutcome
from hicache_ray.storage.page_format import ReadOut
from hicache_ray.storage.paged import PagedBackend
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    controller_config,
    fill_pages,
    make_controller,
    prompt,
    stored,
)

KV = make_kv(page_size=PAGE)
WAIT_S = 30.0  # bounds every wait on another thread (never reached when the code is right)


class _GatedReads(MemoryObjects):
    """A memory store whose reads wait until ``gate`` is set; counts its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.reading = threading.Event()
        self.writes = 0

    def read_many(self, keys: Sequence[str], outs: Sequence[ReadOut]) -> list[ReadOutcome]:
        self.reading.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().read_many(keys, outs)

    def write_many(self, keys, headers, payloads):  # type: ignore[no-untyped-def]
        self.writes += 1
        return super().write_many(keys, headers, payloads)


def _waited(turn: ReadsFirst, waits: int) -> bool:
    """Wait until ``turn`` has held a backup ``waits`` times."""
    with turn._cond:
        return turn._cond.wait_for(lambda: turn.waits >= waits, WAIT_S)


Pipelines = tuple[_GatedReads, HostPool, BackupPipeline, PrefetchPipeline]


@pytest.fixture
def pipelines(request: pytest.FixtureRequest) -> Iterator[Pipelines]:
    host_pages = getattr(request, "param", 64)
    objects = _GatedReads()
    stored(objects, prompt(1, 32))  # 8 pages in L3 for the prefetch to read
    objects.writes = 0
    plan = plan_shard(KV, controller_config())
    backend = PagedBackend("memory", objects, plan, scan_on_start=False)
    pool = HostPool(KV, host_pages, "page_first")
    backup = BackupPipeline(backend, plan, pool, 4)
    prefetch = PrefetchPipeline(backend, plan, pool, 4, 1, backup.turn)
    try:
        yield objects, pool, backup, prefetch
    finally:
        objects.gate.set()
        prefetch.close()
        backup.close()


def _read_l3(prefetch: PrefetchPipeline, pool: HostPool, objects: _GatedReads) -> FetchTask:
    """Start an eager prefetch of the 8 stored pages; return once its read waits on the
    store."""
    task = FetchTask(encode_tokens(prompt(1, 32)), 8, 0, "")
    slots = pool.allocator.allocate(8)
    assert slots is not None
    task.host_pages, task.read_end, task.eager = slots, 8, True
    prefetch.submit_query(task)
    assert objects.reading.wait(WAIT_S)
    return task


def _backup(pool: HostPool, pages: int) -> BackupTask:
    slots = pool.allocator.allocate(pages)
    assert slots is not None
    hashes = page_hashes(prompt(2, pages * PAGE), PAGE)
    return BackupTask(TreeNode(1, b"", None), hashes, slots, None)


def test_a_backup_waits_until_every_rank_has_read_an_l3_hit(pipelines: Pipelines) -> None:
    objects, pool, backup, prefetch = pipelines
    task = _read_l3(prefetch, pool, objects)
    job = _backup(pool, 2)
    backup.submit(job)
    assert _waited(backup.turn, 1)  # held before its first store call
    assert objects.writes == 0 and not job.done
    objects.gate.set()  # this rank's read ends ...
    assert task.read_finished.wait(WAIT_S) and task.pages_read == 8
    assert backup.turn.reading == 1  # ... but its peers may still be reading
    prefetch.give_up(task)  # as the claims do once every rank's reads are agreed done
    assert job.finished.wait(WAIT_S) and job.ok and job.stored_pages == 2
    assert objects.writes == 1 and backup.turn.waits == 1


def test_the_step_that_agrees_the_reads_are_done_frees_the_backups() -> None:
    objects = _GatedReads()
    tokens = prompt(3, 40)
    stored(objects, tokens)
    ctl = make_controller(controller_config(), KV, objects)
    try:
        assert ctl.prefetch is not None
        turn = ctl.prefetch.turn
        ctl.step([Arrival("r", [*tokens, 1])])
        task = ctl.known["r"].task
        assert task is not None and objects.reading.wait(WAIT_S)
        objects.gate.set()
        assert task.read_finished.wait(WAIT_S)
        assert turn.reading == 1  # read here; no step has agreed on it yet
        while "r" not in ctl.step().runnable:
            ctl.settle(timeout=WAIT_S)
        assert turn.reading == 0  # free before the request is even taken
        ctl.cancel("r")
    finally:
        ctl.close()


def test_settle_runs_the_backups_a_read_no_step_has_agreed_would_hold() -> None:
    """``settle`` waits for every backup on the caller's thread, so no step can agree a
    finished read done meanwhile: the backups it holds run now (they held settle to its
    whole timeout before, and a drain loop with no timeout forever)."""
    objects = _GatedReads()
    stored(objects, hit := prompt(3, 40))
    objects.writes = 0
    ctl = make_controller(controller_config(), KV, objects)
    try:
        assert ctl.backup is not None
        ctl.step([Arrival("r", [*hit, 1])])  # its L3 read waits on the gate
        assert objects.reading.wait(WAIT_S)
        tokens = prompt(4, 16)
        assert "w" in ctl.step([Arrival("w", tokens)]).runnable  # nothing to read
        handle = ctl.take("w")
        ctl.reserve(handle, len(tokens))
        fill_pages(ctl, handle, tokens, 0)
        ctl.finish(handle, tokens)  # its pages go to L2, then (write-through) to L3
        while not ctl.acks.pending_backups:  # the host writes, acknowledged by a step
            ctl.cache.flush()
            ctl.step()
        assert _waited(ctl.backup.turn, 1)  # the backup waits for the read
        objects.gate.set()
        ctl.settle(timeout=WAIT_S)  # the read ends here; no step agrees it done
        assert ctl.backup.turn.reading == 1 and objects.writes >= 1
        assert all(task.done for task in ctl.acks._backups)
        ctl.cancel("r")
    finally:
        ctl.close()


def test_a_read_its_request_gave_up_holds_no_backup(pipelines: Pipelines) -> None:
    objects, pool, backup, prefetch = pipelines
    task = _read_l3(prefetch, pool, objects)
    job = _backup(pool, 2)
    backup.submit(job)
    assert _waited(backup.turn, 1)
    task.cancelled = True  # as the claims do when the request is taken or cancelled
    prefetch.give_up(task)
    assert job.finished.wait(WAIT_S) and job.ok
    assert not objects.gate.is_set()  # while the read still waits on the store


def test_a_read_given_up_before_the_query_thread_starts_it_holds_no_backup(
    pipelines: Pipelines,
) -> None:
    """The query thread checks ``cancelled``, the scheduler thread gives the task up, then
    the query thread starts its read: nothing would end it again."""
    _, pool, backup, prefetch = pipelines
    task = FetchTask(encode_tokens(prompt(1, 32)), 8, 0, "")
    task.cancelled = True  # as the claims do, then give it up ...
    prefetch.give_up(task)
    prefetch.submit_read(task)  # ... and only now the query thread's call arrives
    assert prefetch.turn.reading == 0
    job = _backup(pool, 2)
    backup.submit(job)
    assert job.finished.wait(WAIT_S) and job.ok and backup.turn.waits == 0
    assert task.read_finished.wait(WAIT_S)  # the reader saw it cancelled and let it go


@pytest.mark.parametrize("pipelines", [16], indirect=True)
def test_a_backlog_of_an_eighth_of_l2_does_not_wait(pipelines: Pipelines) -> None:
    objects, pool, backup, prefetch = pipelines
    _read_l3(prefetch, pool, objects)
    job = _backup(pool, 2)  # 2 of 16 L2 pages: 1/8 of L2 waits on backups
    backup.submit(job)
    assert job.finished.wait(WAIT_S) and job.ok  # while the read still waits on the store
    assert not objects.gate.is_set() and backup.turn.waits == 0


def test_no_read_in_flight_holds_nothing_and_closing_lets_a_held_backup_go() -> None:
    turn = ReadsFirst(host_pages=64)
    assert turn.turn() is False  # nothing read: no wait
    turn.begin(task := object())
    turn.begin(task)  # a task counts once
    assert turn.reading == 1
    went = threading.Event()
    held = threading.Thread(target=lambda: went.set() if turn.turn() else None)
    held.start()
    assert _waited(turn, 1)
    turn.close()
    held.join(WAIT_S)
    assert went.is_set() and not held.is_alive()


def test_the_controller_shares_one_turn_and_reports_its_waits() -> None:
    ctl = make_controller(controller_config(), KV, MemoryObjects())
    try:
        assert ctl.backup is not None and ctl.prefetch is not None
        assert ctl.prefetch.turn is ctl.backup.turn  # the reads it counts hold the backups
        ctl.backup.turn.waits = 3
        assert ctl.stats().backup_waited_for_reads == 3
    finally:
        ctl.close()


def _was_delayed(turn: ReadsFirst) -> bool:
    """Wait until a backup waits in ``turn.after``."""
    with turn._cond:
        return turn._cond.wait_for(lambda: turn.delayed == 1, WAIT_S)


def _delayed(turn: ReadsFirst) -> threading.Thread:
    """A backup thread waiting in ``after`` for a minute; returns once it waits there."""
    held = threading.Thread(target=turn.after, args=(time.monotonic() + 60.0,))
    held.start()
    assert _was_delayed(turn)
    return held


@pytest.mark.parametrize("release", ["read", "awaited", "closed", "behind"])
def test_a_backup_starts_a_moment_after_its_submission_unless_something_comes_first(
    release: str,
) -> None:
    turn = ReadsFirst(host_pages=64)
    turn.after(time.monotonic() - 1.0)  # its moment has passed: no wait
    assert turn.delayed == 0
    held = _delayed(turn)
    assert held.is_alive()  # 60 s from its submission
    with turn.awaited() if release == "awaited" else contextlib.nullcontext():  # settle
        if release == "read":  # a query is submitted: ``turn`` holds the backup from here
            turn.begin(object())
        elif release == "closed":
            turn.close()
        elif release == "behind":
            turn.backlog(8)  # 8 of 64 L2 pages wait on backups: no time to lose
        held.join(WAIT_S)
    assert not held.is_alive()


def test_a_delayed_backup_sees_the_next_requests_lookup_begin_and_waits_for_its_read(
    pipelines: Pipelines,
) -> None:
    """The pattern the delay is for: a request's backup is submitted as it finishes, and
    the next request's L3 lookup starts before the backup's first store call."""
    objects, pool, backup, prefetch = pipelines
    backup.worker.delay_s = 60.0
    job = _backup(pool, 2)
    backup.submit(job)
    assert _was_delayed(backup.turn)
    task = _read_l3(prefetch, pool, objects)  # the next request's lookup and read
    assert _waited(backup.turn, 1)  # out of its delay, held for the read
    assert objects.writes == 0 and not job.done
    objects.gate.set()
    assert task.read_finished.wait(WAIT_S)
    prefetch.give_up(task)
    assert job.finished.wait(WAIT_S) and job.ok and objects.writes == 1
