"""A long poll on a rank's cache-event journal: a subscriber asking for the batches after
the last one waits (up to its ``wait_s``) for the next flush instead of asking again every
few milliseconds. The journal flushes on the step thread; waiters wait on the actor's
event loop, which the flush wakes through ``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import contextlib

from hicache_ray.cache.events import CacheEvents

__all__ = ["FlushWatch", "Ticker"]


class Ticker:
    """What a long poll waits on: :meth:`tick` (on the event loop) wakes every
    :meth:`wait` in progress."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    async def wait(self, wait_s: float) -> None:
        """Return at the next :meth:`tick`, or after ``wait_s``."""
        event = self._event = self._event or asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), wait_s)

    def tick(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()


class FlushWatch:
    """Wakes the long polls of one actor at each new batch of the journal they watch."""

    def __init__(self) -> None:
        self._ticker = Ticker()
        self._watched: CacheEvents | None = None

    async def wait(self, journal: CacheEvents, seq: int, wait_s: float) -> None:
        """Return when ``journal`` has a batch after ``seq`` or ``wait_s`` has passed."""
        if wait_s <= 0 or journal.seq != seq:
            return
        if journal is not self._watched:  # a new generation's journal: watch it
            loop = asyncio.get_running_loop()

            def tell() -> None:  # on the step thread
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(self._ticker.tick)

            journal.on_flush(tell)
            self._watched = journal
        if journal.seq == seq:  # not flushed before the watch was set
            await self._ticker.wait(wait_s)
