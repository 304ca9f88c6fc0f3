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

_DRAIN_POLL_S = 0.05


class LoopThread:
    """A daemon thread running an event loop until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the loop; the future holds its outcome."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop once the coroutines still on it have ended (they are expected to
        end soon: a closed deployment fails them at their next wait slice). Idempotent."""
        if not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._drain(), self.loop)

    async def _drain(self) -> None:
        me = asyncio.current_task()
        while any(t is not me and not t.done() for t in asyncio.all_tasks()):
            await asyncio.sleep(_DRAIN_POLL_S)
        self.loop.stop()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()
