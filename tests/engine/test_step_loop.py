"""The step loop without Ray: idempotent start/stop, chores between steps, errors, pace."""

from __future__ import annotations

import threading

import pytest

from hicache_ray.engine.step_loop import StepLoop, StepLoopStopped


class Recorder:
    def __init__(self, fail_at: int | None = None, pace_s: float = 0.0) -> None:
        self.steps = 0
        self.threads: set[str] = set()
        self.errors: list[BaseException] = []
        self.stepped = threading.Event()
        self.fail_at = fail_at
        self.pace_s = pace_s

    def step(self) -> None:
        self.steps += 1
        self.threads.add(threading.current_thread().name)
        self.stepped.set()
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError(f"step {self.steps} failed")

    def loop(self) -> StepLoop:
        return StepLoop(self.step, pace=lambda: self.pace_s, on_error=self.errors.append, name="t")


def test_start_and_stop_are_idempotent() -> None:
    rec = Recorder()
    loop = rec.loop()
    assert loop.stop(timeout=1)  # before start: nothing to stop
    rec = Recorder()
    loop = rec.loop()
    loop.start()
    loop.start()
    assert rec.stepped.wait(10)
    assert loop.stop(timeout=10) and loop.stop(timeout=10)
    assert not loop.running and rec.threads == {"t"} and not rec.errors


def test_chores_run_on_the_loop_thread_between_steps() -> None:
    rec = Recorder(pace_s=60.0)  # idle: only wake() (a queued chore wakes it) makes it step
    loop = rec.loop()
    assert loop.between_steps(lambda: threading.current_thread().name) != "t"  # not running
    loop.start()
    assert loop.between_steps(lambda: threading.current_thread().name, timeout=10) == "t"
    with pytest.raises(ZeroDivisionError):
        loop.between_steps(lambda: 1 // 0, timeout=10)
    loop.stop(timeout=10)
    # once stopped, a chore runs on the caller's thread (nothing else steps)
    assert loop.between_steps(lambda: 42) == 42


def test_a_failing_step_ends_the_loop_and_reports_once() -> None:
    rec = Recorder(fail_at=3)
    loop = rec.loop()
    loop.start()
    loop._thread.join(10)  # type: ignore[union-attr]
    assert not loop.running and len(rec.errors) == 1 and "step 3 failed" in str(rec.errors[0])
    assert loop.error is rec.errors[0] and loop.steps == 2


def test_an_error_while_stopping_is_expected_not_reported() -> None:
    release = threading.Event()
    entered = threading.Event()
    errors: list[BaseException] = []

    def step() -> None:
        entered.set()
        release.wait(10)
        raise RuntimeError("peer went away")  # what a collective does when peers stop

    loop = StepLoop(step, pace=lambda: 0.0, on_error=errors.append)
    loop.start()
    assert entered.wait(10)
    loop.request_stop()
    release.set()
    assert loop.stop(timeout=10) and not errors and isinstance(loop.error, RuntimeError)


def test_chores_left_behind_by_a_failed_loop_fail() -> None:
    entered = threading.Event()
    release = threading.Event()

    def step() -> None:
        entered.set()
        release.wait(10)
        raise RuntimeError("boom")

    loop = StepLoop(step, pace=lambda: 0.0, on_error=lambda exc: None)
    loop.start()
    assert entered.wait(10)
    result: list[BaseException] = []

    def queue_chore() -> None:
        try:
            loop.between_steps(lambda: None, timeout=10)
        except StepLoopStopped as exc:
            result.append(exc)

    waiter = threading.Thread(target=queue_chore)
    waiter.start()
    release.set()
    waiter.join(10)
    assert not waiter.is_alive()
    # the chore either was queued and failed with the loop, or ran after it ended
    assert len(result) <= 1 and not loop.running


def test_outside_step_time_grows_while_idle() -> None:
    rec = Recorder(pace_s=60.0)
    loop = rec.loop()
    loop.start()
    loop.wake()
    assert rec.stepped.wait(10)
    loop.between_steps(lambda: None, timeout=10)
    first = loop.outside_step_s
    second = loop.outside_step_s
    assert first is not None and second is not None and second >= first
    loop.stop(timeout=10)
