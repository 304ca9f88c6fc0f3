"""Why an L3 task (a prefetch's query and reads, a backup's writes) stopped short."""

from __future__ import annotations

import enum

__all__ = ["Failure"]


class Failure(str, enum.Enum):
    """A task's ``failure``; ``None`` there means it did not fail."""

    QUERY_FAILED = "query_failed"  # the existence query raised: the request recomputes
    READ_FAILED = "read_failed"  # a read or a checksum failed: the pages read so far count
    WRITE_FAILED = "write_failed"  # a write raised: the pages stored so far count
    PARENT_NOT_STORED = "parent_not_stored"  # the parent node's backup failed first

    def __str__(self) -> str:
        return self.value
