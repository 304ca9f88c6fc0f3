"""A long poll on a rank's cache-event journal: a subscriber asking for the batches after
the last one waits (up to its ``wait_s``) for the next flush instead of asking again every
few milliseconds. The journal flushes on the step thread; waiters wait on the actor's
event loop, which the flush wakes through ``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import contextlib

from hicache_ray.cache.events import CacheEvents

__all__ = ["FlushWatch"]


class FlushWatch:
    """Wakes the long polls of one actor at each new batch of the journal they watch."""

    def __init__(self) -> None:
        self._tick: asyncio.Event | None = None
        self._watched: CacheEvents | None = None

    async def wait(self, journal: CacheEvents, seq: int, wait_s: float) -> None:
        """Return when ``journal`` has a batch after ``seq`` or ``wait_s`` has passed."""
        if wait_s <= 0 or journal.seq != seq:
            return
        if journal is not self._watched:  # a new generation's journal: watch it
            loop = asyncio.get_running_loop()

            def tell() -> None:  # on the step thread
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(self._ticked)

            journal.on_flush(tell)
            self._watched = journal
        tick = self._tick = self._tick or asyncio.Event()
        if journal.seq != seq:  # flushed before the watch was set
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tick.wait(), wait_s)

    def _ticked(self) -> None:
        tick, self._tick = self._tick, None
        if tick is not None:
            tick.set()
