"""A caller of rank 0 waiting for one request (``RankActor.generate`` and its stream)."""

from __future__ import annotations

import asyncio
from typing import Any

from hicache_ray.engine.request import RequestResult, StreamChunk

__all__ = ["Waiter"]


class Waiter:
    """A caller of rank 0 waiting for one request: its loop, its result, and for a stream
    the queue of chunks (the step thread fills both through ``call_soon_threadsafe``)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        chunks: asyncio.Queue[StreamChunk | Exception] | None,
    ) -> None:
        self.loop = loop
        self.future = future
        self.chunks = chunks

    def succeed(self, result: RequestResult) -> None:
        if self.chunks is not None:
            self.chunks.put_nowait(StreamChunk(tokens=[], result=result))
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, error: Exception) -> None:
        if self.chunks is not None:
            self.chunks.put_nowait(error)
        if not self.future.done():
            self.future.set_exception(error)
            self.future.exception()  # retrieved: a stream's caller reads the queue instead
