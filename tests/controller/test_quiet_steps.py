"""Quiet steps: when nothing runs and no rank admits anything, each rank finishes its own
L3 reads before it takes its facts, so the step that sees the last read end is that step
(not a later poll); a step that admits, one with work to run, and a prefetch deadline end
the wait."""

from __future__ import annotations

import threading
from collections.abc import Callable

from hicache_ray.cache.controller import Arrival
from hicache_ray.cache.controller.fetch_task import FetchTask
from hicache_ray.storage import MemoryObjects
from tests.conftest import make_kv
from tests.controller.driven import Driven
from tests.controller.helpers import (
    PAGE,
    controller_config,
    drain,
    make_controller,
    prompt,
    stored,
)
from tests.controller.test_eager_reads import WaitingConsensus
from tests.helpers import FakeClock

KV = make_kv(page_size=PAGE)
LONG_S = 60.0  # far above any machine's read of these pages: only their end ends a wait


def _reading(seed: int, **config: object) -> tuple[Driven, WaitingConsensus, threading.Event]:
    """A reader whose request ``r`` is reading its 10 L3 pages, held until the returned
    event is set."""
    objects = MemoryObjects()
    tokens = prompt(seed, 40)
    stored(objects, tokens)
    consensus = WaitingConsensus()
    clock = config.pop("clock", None)
    reader = make_controller(
        controller_config(**config),  # type: ignore[arg-type]
        KV,
        objects,
        consensus=consensus,
        clock=clock,  # type: ignore[arg-type]
    )
    reader.ctl.quiet_wait_s = LONG_S
    assert reader.prefetch is not None
    worker = reader.prefetch.read
    read, gate = worker._read, threading.Event()

    def gated(task: FetchTask) -> None:
        assert gate.wait(LONG_S)
        read(task)

    worker._read = gated  # type: ignore[method-assign]
    reader.step([Arrival("r", [*tokens, 1])])
    task = reader.known["r"].task
    assert task is not None and task.queried.wait(30) and task.read_started
    return reader, consensus, gate


def _close(reader: Driven, gate: threading.Event) -> None:
    gate.set()
    for rid in list(reader.known):
        reader.cancel(rid)
    drain(reader)
    reader.check_integrity()
    reader.close()


def test_a_quiet_step_agrees_a_read_that_ends_after_its_first_round() -> None:
    reader, consensus, gate = _reading(61)
    consensus.during = gate.set  # the read goes on after round 1; the step waits for it
    assert reader.step(quiet=True).runnable == ["r"]
    assert 0 < reader.stats().quiet_wait_s < LONG_S
    handle = reader.take("r")
    assert handle.num_cached_tokens == 10 * PAGE
    reader.release(handle)
    _close(reader, gate)


def _unheld(reader: Driven, step: Callable[[], object]) -> None:
    """``step`` returns with the read still held, and waited for nothing."""
    step()
    task = reader.known["r"].task
    assert task is not None and not task.read_finished.is_set()
    assert reader.stats().quiet_wait_s == 0


def test_a_step_with_work_to_run_does_not_wait() -> None:
    reader, _, gate = _reading(62)
    _unheld(reader, lambda: reader.step(quiet=False))
    _close(reader, gate)


def test_a_step_that_admits_does_not_wait() -> None:
    reader, _, gate = _reading(63)
    _unheld(reader, lambda: reader.step([Arrival("s", prompt(64, 8))], quiet=True))
    _close(reader, gate)


def test_a_quiet_step_does_not_wait_past_a_prefetch_deadline() -> None:
    clock = FakeClock()
    reader, _, gate = _reading(65, prefetch_policy="timeout", clock=clock)
    claim = reader.known["r"]
    clock.now = claim.deadline - 0.001  # the read may hold the request 1 ms more
    assert reader.step(quiet=True).runnable == []
    assert claim.task is not None and not claim.task.read_finished.is_set()
    assert reader.stats().quiet_wait_s < LONG_S / 2
    _close(reader, gate)
