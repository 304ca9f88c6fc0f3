"""The one skeleton of the background threads (copies, L3 queries, reads and backups): a
daemon thread serving the items of its ``inbox`` in order until it gets ``None``."""

from __future__ import annotations

import queue
import threading
from typing import Generic, TypeVar

__all__ = ["InboxWorker"]

T = TypeVar("T")


class InboxWorker(threading.Thread, Generic[T]):
    """Serve each item put in ``inbox``: :meth:`handle` it; :meth:`failed` if that raised
    (a worker never dies of one item); :meth:`finished` in any case. ``None`` ends it."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.inbox: queue.SimpleQueue[T | None] = queue.SimpleQueue()

    def run(self) -> None:
        self.starting()
        while (item := self.inbox.get()) is not None:
            try:
                self.handle(item)
            except Exception as exc:
                self.failed(item, exc)
            finally:
                self.finished(item)

    def starting(self) -> None:
        """On the thread, before the first item."""

    def handle(self, item: T) -> None:
        raise NotImplementedError

    def failed(self, item: T, exc: Exception) -> None:
        """``handle(item)`` raised ``exc``."""

    def finished(self, item: T) -> None:
        """Done with ``item``, whether it failed or not."""
