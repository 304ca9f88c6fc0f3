"""A cache router run in the test process, following an application's real index on an
event loop of its own, as in an ingress (the routing fault tests read its copy)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

from hicache_ray.keys import page_hashes


class Follower:
    """A cache router of the app in this process: its own task keeps its copy of the
    index, on an event loop of its own, as in an ingress."""

    def __init__(self, page_size: int) -> None:
        from actors.routing import CacheAwareRouter

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.router: Any = CacheAwareRouter.__new__(CacheAwareRouter)
        self.page_size = page_size
        self.router.initialize_state(app=f"openai-{os.getpid()}", page_size=page_size, wait_s=30)
        self.router._replica_queue_len_cache = SimpleNamespace(get=lambda _: 0)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def device(self, replica: str, prompt: list[int]) -> int:
        """Leading pages of ``prompt`` in ``replica``'s L1, as this router's copy shows."""

        async def read(hashes: list[str]) -> int:
            await self.router._facts([replica], hashes)  # starts its task on the first call
            return int(self.router._copy.index.hits(replica, hashes).device)

        return int(self._run(read(page_hashes(prompt, self.page_size))))

    def first(self, replicas: list[str], prompt: list[int]) -> str:
        """Where this router sends ``prompt`` first (no work pending anywhere)."""
        fake = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in replicas]
        hashes = page_hashes(prompt, self.page_size)
        ranked = self._run(self.router._ranked(fake, len(prompt), hashes, False))
        return str(ranked[0][0].replica_id.unique_id)

    def down(self) -> frozenset[str]:
        """The replicas this router's copy has down (ranks died, not re-formed)."""

        async def read() -> frozenset[str]:
            return frozenset(self.router._copy.index.down)

        return frozenset(self._run(read()))

    def copy_fresh(self) -> bool:
        """This router's copy was updated within the second (it reads no other then)."""
        from actors.routing import COPY_FRESH_S

        return bool(time.monotonic() - self.router._copy_at < COPY_FRESH_S)

    def close(self) -> None:
        async def stop() -> None:
            if self.router._follower is not None:
                self.router._follower.cancel()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
