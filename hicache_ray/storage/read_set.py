"""Where a prepared read lands: each object's destination and shape, made before the store
answers (:meth:`StorageBackend.prepare_get`, :meth:`StorageBackend.prepare_get_rows`).

A read into a pool's pages names each object's place as a row of one tensor per object
of a page (``[pages, *object shape]``): the rows are checked once a read, and each page's
place is a numpy row of them. That costs about 1 us an object, against about 6 us for a
tensor view of it checked on its own: a 4,096-token TP=2 L3 hit reads 514 objects a rank,
and on 2 cores that set-up ran beside its ranks' copies (an L3 hit's wait fell by about
2.5 ms on the median of 18 fresh deployments when it cost nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, overload

import torch

from hicache_ray.keys import ShardPlan
from hicache_ray.keys.plan import PAGE_HASH_CHARS
from hicache_ray.storage.page_format import ReadOut, StridedOut, int_array, tensor_problem

__all__ = ["ReadSet", "RowBuffers", "check_row_read", "row_outs", "rows_problem"]


class ReadSet(NamedTuple):
    """A prepared read's destinations (``outs``) and each object's shape (``shapes``, what
    its stored header must say), key by key."""

    outs: list[ReadOut]
    shapes: list[tuple[int, ...]]


def check_row_read(keys: Sequence[str], rows: Sequence[torch.Tensor], slots: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``keys`` name ``len(rows)`` objects for each of ``slots``,
    each slot an int inside every row tensor."""
    per = len(rows)
    if per == 0 or len(keys) != per * len(slots):
        raise ValueError(
            f"{len(keys)} keys for {len(slots)} pages of {per} objects each: "
            "give one key per object of each page, page by page"
        )
    pages = min(int(r.shape[0]) if r.dim() else 0 for r in rows)
    for slot in slots:
        if type(slot) is not int or not 0 <= slot < pages:
            raise ValueError(f"page slot {slot!r} outside [0, {pages})")


def rows_problem(
    plan: ShardPlan, dtype: torch.dtype, keys: Sequence[str], rows: Sequence[torch.Tensor]
) -> str | None:
    """What is wrong with ``rows`` (one per object of a page) as the places of ``keys``'s
    objects under ``plan`` (key ``j`` is object ``j % len(rows)`` of its page); None if
    nothing. Each row tensor is checked once; each key's object by its suffix."""
    per = len(rows)
    suffixes = []
    for i, row in enumerate(rows):
        spec = plan.spec_of(keys[i])
        if spec is None:
            return f"key {keys[i]} is not one of this rank's objects ({plan.tag})"
        if not isinstance(row, torch.Tensor) or row.dim() != len(spec.shape) + 1:
            return f"rows {i}: expected a tensor [pages, *{list(spec.shape)}]"
        problem = tensor_problem(row[0], dtype, spec.shape, contiguous=False)
        if problem is not None:
            return f"rows {i}: {problem}"
        suffixes.append(spec.suffix)
    for j, key in enumerate(keys):
        if key[PAGE_HASH_CHARS + 1 :] != suffixes[j % per]:
            return f"key {key} is not object {j % per} of a page ({suffixes[j % per]})"
    return None


def row_outs(rows: Sequence[torch.Tensor], slots: Sequence[int]) -> list[ReadOut]:
    """The destinations of each object of each page in ``slots``, page by page."""
    kinds = [(int_array(r), r[0].is_contiguous()) for r in rows]
    outs: list[ReadOut] = []
    for slot in slots:
        for array, contiguous in kinds:
            row = array[slot]
            outs.append(memoryview(row).cast("B") if contiguous else StridedOut.of_array(row))
    return outs


class RowBuffers(Sequence[torch.Tensor]):
    """The buffers of a read into rows (key ``j``: page ``j // len(rows)``'s object
    ``j % len(rows)``), each a tensor view made when asked for."""

    def __init__(self, rows: Sequence[torch.Tensor], slots: Sequence[int]) -> None:
        self._rows, self._slots = list(rows), list(slots)

    def __len__(self) -> int:
        return len(self._slots) * len(self._rows)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        page, obj = divmod(i % len(self), len(self._rows))
        return self._rows[obj][self._slots[page]]
