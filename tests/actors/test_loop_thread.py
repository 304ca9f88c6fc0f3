"""The I/O loop of a deployment's synchronous API: runs coroutines, drains, then stops."""

from __future__ import annotations

import asyncio
import threading

from actors.loop_thread import LoopThread


def test_coroutines_run_on_the_loop_thread_and_close_waits_for_them() -> None:
    io = LoopThread("test-io")
    release = threading.Event()

    async def work(x: int) -> tuple[int, str]:
        await asyncio.get_running_loop().run_in_executor(None, release.wait)
        return x * 2, threading.current_thread().name

    futures = [io.run(work(i)) for i in range(3)]
    io.close()  # the running coroutines end first
    assert not any(f.done() for f in futures)
    release.set()
    assert [f.result(timeout=30) for f in futures] == [(i * 2, "test-io") for i in range(3)]
    io._thread.join(timeout=30)
    assert not io._thread.is_alive() and io.loop.is_closed()
    io.close()  # again: nothing to do
