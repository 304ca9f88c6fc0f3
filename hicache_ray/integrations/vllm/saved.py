"""What a vLLM worker's connector stored, reported to the scheduler side through vLLM's
KV-event channel (``get_kv_connector_kv_cache_events``): the scheduler side turns the page
hashes into acknowledgements and L3 cache events."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents

__all__ = ["SavedPages"]


class SavedPages(KVConnectorKVEvents):  # type: ignore[misc]
    """The page hashes a worker stored since its last report, on their way to the
    scheduler side (vLLM adds the workers' reports of one step together)."""

    def __init__(self, pages: list[str] | None = None) -> None:
        self._pages = list(pages or [])
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._pages.extend(events)

    def aggregate(self) -> SavedPages:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._pages)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._pages = []
