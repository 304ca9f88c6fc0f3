"""A background step loop that can be started, stopped, and handed work between steps.

Threading model: one thread (``hicache-step-*``) calls ``step()`` until :meth:`StepLoop.stop`
or until a step raises. Before each step it runs the chores other threads queued with
:meth:`StepLoop.between_steps` (work that must not overlap a step, such as evicting the
cache), then waits ``pace()`` seconds unless :meth:`StepLoop.wake` is called. A step is never
interrupted: ``stop`` lets the current one finish (or fail: a step blocked in a collective
ends when its peers stop or die), and an error raised while stopping is expected and only
logged at debug level.

Fields shared across threads:

* ``_lock`` guards ``_chores``, ``_finished`` and ``_thread`` (set once);
* ``_stop``, ``_wake``: events (thread-safe);
* ``error``, ``in_step``, ``_step_ended``, ``steps``: written by the loop thread only; other
  threads read them without a lock (a word-sized read of a value that only moves forward).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["StepLoop", "StepLoopStopped"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class StepLoopStopped(RuntimeError):
    """A chore was queued on, or left behind by, a loop that is not running."""


class StepLoop:
    """Runs ``step`` on its own thread (see the module docstring).

    Args:
        step: one iteration; an exception ends the loop and is passed to ``on_error``.
        pace: seconds to wait before the next step (0: at once; :meth:`wake` cuts it short).
        on_error: called on the loop thread with the exception that ended it (not when the
            loop was being stopped).
        name: the thread's name.
    """

    def __init__(
        self,
        step: Callable[[], None],
        *,
        pace: Callable[[], float],
        on_error: Callable[[BaseException], None],
        name: str = "hicache-step",
    ) -> None:
        self._step = step
        self._pace = pace
        self._on_error = on_error
        self._name = name
        self._lock = threading.Lock()
        self._chores: list[tuple[Callable[[], Any], Future[Any]]] = []  # guarded by _lock
        self._finished = False  # guarded by _lock: the thread has ended
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.in_step = False
        self.steps = 0
        self._step_ended = time.monotonic()

    # ----------------------------------------------------------------- control

    def start(self) -> None:
        """Start the thread; a second call does nothing."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the loop to end after the current step and wait up to ``timeout`` for it;
        returns whether the thread has ended. Safe to call twice or before :meth:`start`."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def request_stop(self) -> None:
        """Mark the loop as stopping without waiting (errors from now on are expected)."""
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Cut the current wait short: step now."""
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def outside_step_s(self) -> float | None:
        """Seconds since the last step ended (None while in a step): a stalled loop's
        grows past any timeout."""
        return None if self.in_step else time.monotonic() - self._step_ended

    def between_steps(self, chore: Callable[[], T], timeout: float = 60.0) -> T:
        """Run ``chore`` on the loop thread between two steps and return its result; runs
        it here when the loop is not running (then nothing else steps).

        Raises:
            StepLoopStopped: the loop ended before running it.
            TimeoutError: it did not run within ``timeout``.
        """
        done: Future[T] = Future()
        with self._lock:
            queued = self._thread is not None and not self._finished
            if queued:
                self._chores.append((chore, done))
        if not queued:
            return chore()
        self._wake.set()
        return done.result(timeout=timeout)

    # -------------------------------------------------------------------- loop

    def _run_chores(self) -> None:
        with self._lock:
            chores, self._chores = self._chores, []
        for chore, done in chores:
            try:
                done.set_result(chore())
            except Exception as exc:
                done.set_exception(exc)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_chores()
                delay = self._pace()
                if delay > 0:
                    self._wake.wait(delay)
                self._wake.clear()
                if self._stop.is_set():
                    break
                self.in_step = True
                self._step()
                self.in_step = False
                self.steps += 1
                self._step_ended = time.monotonic()
        except Exception as exc:
            self.in_step = False
            self.error = exc
            if self._stop.is_set():
                log.debug("%s: step ended while stopping: %s", self._name, exc)
            else:
                self._on_error(exc)
        finally:
            with self._lock:
                left, self._chores = self._chores, []
                self._finished = True
                self._stop.set()
            for _, done in left:
                done.set_exception(StepLoopStopped(f"{self._name} stopped"))
