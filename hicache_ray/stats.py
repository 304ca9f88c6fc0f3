"""Counters of one rank's cache.

``CacheStats`` doubles as the live counters (mutated only by the cache's own thread) and,
through :meth:`CacheStats.snapshot`, as the copy handed to anyone else.
"""

from __future__ import annotations

import msgspec

__all__ = ["CacheStats"]


class CacheStats(msgspec.Struct, kw_only=True):
    """Counts since the cache started."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    loaded_pages: int = 0
    written_pages: int = 0
    bytes_loaded: int = 0
    bytes_written: int = 0
    device_evicted_pages: int = 0
    host_evicted_pages: int = 0
    load_failures: int = 0
    write_failures: int = 0
    load_skipped_device_full: int = 0
    write_skipped_host_full: int = 0

    def snapshot(self) -> CacheStats:
        """An independent copy."""
        return msgspec.structs.replace(self)
