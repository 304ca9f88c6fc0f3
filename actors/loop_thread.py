"""An asyncio event loop on a thread of its own: where a driver's synchronous calls run their
coroutines (``Deployment.generate`` and ``submit`` share the asyncio path's retry loop)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """A daemon thread running an event loop until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._pending: set[Future[Any]] = set()  # guarded by _lock: not answered yet
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the loop; the future holds its outcome."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._answered)
        return future

    def _answered(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def close(self) -> None:
        """Stop the loop once the coroutines still on it have ended (they are expected to
        end soon: a closed deployment fails them at their next wait slice). Idempotent."""
        if not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._drain(), self.loop)

    async def _drain(self) -> None:
        # NOTE: the callers' futures, not the loop's tasks: a task that ended has yet to
        # hand its outcome to its caller's future (a callback on this loop) until then.
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                break
            await asyncio.wait([asyncio.wrap_future(f) for f in pending])
        self.loop.stop()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()
