"""L2: the host KV pool, in one of three layouts.

Shapes (S = slots: 2 for K/V, 1 for MLA; P = page size; H = local heads; D = slot dim;
L = local layers; Lg = layers of one group of ``page_first_direct``):

    layout             tensor(s)                          contiguous unit
    -----------------  ---------------------------------  ------------------------------
    layer_first        [S, L, pages * P, H, D]            one layer of one slot
    page_first         [pages, L, S, P, H, D]             one page, all layers
    page_first_direct  per group g: [pages, Lg, S, P, H, D]  one page of one layer group

A page's storage bytes are in the order ``[L, S, P, H, D]`` whatever the layout; in
``page_first`` (and ``page_first_direct`` with one group) they are a zero-copy view.
Memory is pinned when CUDA is present so copies to the device can be asynchronous.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache_ray.base.config import MemLayout
from hicache_ray.base.layout import ShardKV
from hicache_ray.base.views import byte_view
from hicache_ray.cache.memory.allocator import PageAllocator

__all__ = ["HostPool"]


class HostPool:
    """Host KV buffers plus a lazily merging page allocator."""

    def __init__(
        self,
        kv: ShardKV,
        num_pages: int,
        layout: MemLayout = "page_first",
        *,
        layer_granule: int = 0,
        pin_memory: bool | None = None,
    ) -> None:
        self.kv = kv
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = kv.page_size
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        s, p, h, d, n = kv.kv_slots, kv.page_size, kv.local_heads, kv.slot_dim, kv.num_layers
        granule = layer_granule or n
        self.group_starts = list(range(0, n, granule)) if layout == "page_first_direct" else [0]

        def alloc(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros(shape, dtype=kv.dtype, pin_memory=pin)

        if layout == "layer_first":
            self.buffers = [alloc((s, n, num_pages * p, h, d))]
        elif layout == "page_first":
            self.buffers = [alloc((num_pages, n, s, p, h, d))]
        elif layout == "page_first_direct":
            self.buffers = [
                alloc((num_pages, min(granule, n - g), s, p, h, d)) for g in self.group_starts
            ]
        else:
            raise ValueError(f"unknown host layout {layout!r}")
        self.allocator = PageAllocator(num_pages, name="host pool")
        self._rows = [[self._make_rows(layer, slot) for slot in range(s)] for layer in range(n)]
        self._rows_np = [[rows.view(torch.uint8).numpy() for rows in layer] for layer in self._rows]
        # (layers, heads) -> that object's view in every page (see object_view)
        self._object_rows: dict[tuple[object, object], torch.Tensor | None] = {}

    def _make_rows(self, layer: int, slot: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.buffers[0][slot, layer].view(self.num_pages, -1)
        if self.layout == "page_first":
            return self.buffers[0][:, layer, slot].flatten(1)
        group = max(i for i, start in enumerate(self.group_starts) if start <= layer)
        return self.buffers[group][:, layer - self.group_starts[group], slot].flatten(1)

    @property
    def available_size(self) -> int:
        """Free token slots."""
        return self.allocator.num_free_pages * self.page_size

    @property
    def size_bytes(self) -> int:
        return self.num_pages * self.kv.page_bytes

    def page_rows(self, layer: int, slot: int) -> torch.Tensor:
        """``[num_pages, page_elems]`` (possibly strided) view of one layer and slot."""
        return self._rows[layer][slot]

    def page_rows_bytes(self, layer: int, slot: int) -> np.ndarray:
        """Like :meth:`page_rows`, as a writable uint8 numpy view."""
        return self._rows_np[layer][slot]

    def read_object(
        self, page: int, layers: tuple[int, int] | None = None, heads: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """The KV of ``page`` for local ``layers`` and ``heads`` ([lo, hi), default all).

        Shape ``[L, S, P, H, D]`` (storage order). A zero-copy view when those bytes are
        contiguous in this layout (a whole page of ``page_first``, a whole layer group of
        ``page_first_direct``), valid only while the page stays allocated; else a copy.
        """
        parts = self._object_parts(page, layers, heads)
        if len(parts) == 1 and parts[0][1].is_contiguous():
            return parts[0][1]
        lo, hi = layers or (0, self.kv.num_layers)
        h_lo, h_hi = heads or (0, self.kv.local_heads)
        kv = self.kv
        out = torch.empty(
            (hi - lo, kv.kv_slots, kv.page_size, h_hi - h_lo, kv.slot_dim), dtype=kv.dtype
        )
        for offset, view in parts:
            out[offset : offset + view.shape[0]].copy_(view)
        return out

    def object_view(
        self, page: int, layers: tuple[int, int] | None = None, heads: tuple[int, int] | None = None
    ) -> torch.Tensor | None:
        """The pool's own bytes of an object when they are one view, contiguous or strided
        (a read from storage lands there directly: a strided view in one strided copy),
        else None (an object spanning layer groups: read into a buffer, then
        :meth:`write_object`)."""
        rows = self.object_rows(layers, heads)
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} outside [0, {self.num_pages})")
        # NOTE: one index into a view of every page (about 2 us) instead of slicing the
        # buffer anew (about 10 us): a 4,096-token L3 hit asks for 512-1,024 of these.
        return None if rows is None else rows[page]

    def object_rows(
        self, layers: tuple[int, int] | None = None, heads: tuple[int, int] | None = None
    ) -> torch.Tensor | None:
        """``[num_pages, *object shape]``: the pool's own bytes of an object in every page
        (``rows[page]`` is :meth:`object_view`), or None when it spans layer groups."""
        key = (layers, heads)
        if key not in self._object_rows:
            self._object_rows[key] = self._rows_of(layers, heads)
        return self._object_rows[key]

    def _rows_of(
        self, layers: tuple[int, int] | None, heads: tuple[int, int] | None
    ) -> torch.Tensor | None:
        """``[num_pages, L', S, P, H', D]``: an object's view in every page, or None when
        it spans layer groups."""
        kv = self.kv
        lo, hi, h_lo, h_hi = self._bounds(layers, heads)
        if self.layout == "layer_first":
            s, _, _, h, d = self.buffers[0].shape
            pages = self.buffers[0].view(s, kv.num_layers, self.num_pages, kv.page_size, h, d)
            return pages.permute(2, 1, 0, 3, 4, 5)[:, lo:hi, :, :, h_lo:h_hi]
        groups = self._groups(lo, hi)
        if len(groups) != 1:
            return None
        buf, start, a, b = groups[0]
        return buf[:, a - start : b - start, :, :, h_lo:h_hi]

    def write_object(
        self,
        page: int,
        data: torch.Tensor,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Copy ``data`` (shaped as :meth:`read_object` returns) into ``page``."""
        parts = self._object_parts(page, layers, heads)
        rows = sum(view.shape[0] for _, view in parts)
        expected = (rows, *parts[0][1].shape[1:])
        if tuple(data.shape) != expected or data.dtype != self.kv.dtype:
            raise ValueError(
                f"object of shape {tuple(data.shape)} {data.dtype}, expected {expected} "
                f"{self.kv.dtype}"
            )
        for offset, view in parts:
            view.copy_(data[offset : offset + view.shape[0]])

    def get_page_bytes(self, page: int) -> memoryview:
        """The bytes of ``page`` in storage order ``[L, S, P, H, D]`` (see :meth:`read_object`)."""
        return byte_view(self.read_object(page))

    def set_page_bytes(self, page: int, data: bytes | memoryview | np.ndarray) -> None:
        """Copy one page's storage-order bytes into ``page``."""
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size != self.kv.page_bytes:
            raise ValueError(f"page payload has {raw.size} bytes, expected {self.kv.page_bytes}")
        src = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
        self.write_object(page, src.view(self.kv.dtype).view(self._page_shape()))

    def _object_parts(
        self, page: int, layers: tuple[int, int] | None, heads: tuple[int, int] | None
    ) -> list[tuple[int, torch.Tensor]]:
        """``(offset, view [L', S, P, H', D])`` pieces of one object, one per layer group."""
        kv = self.kv
        lo, hi, h_lo, h_hi = self._bounds(layers, heads)
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} outside [0, {self.num_pages})")
        p = kv.page_size
        if self.layout == "layer_first":
            view = self.buffers[0][:, lo:hi, page * p : (page + 1) * p].transpose(0, 1)
            return [(0, view[:, :, :, h_lo:h_hi])]
        return [
            (a - lo, buf[page, a - start : b - start, :, :, h_lo:h_hi])
            for buf, start, a, b in self._groups(lo, hi)
        ]

    def _groups(self, lo: int, hi: int) -> list[tuple[torch.Tensor, int, int, int]]:
        """``(buffer, its first layer, a, b)`` of each layer group that layers ``[lo, hi)``
        overlap (``[a, b)``: the overlap); layer_first pools have no groups."""
        ends = [*self.group_starts[1:], self.kv.num_layers]
        spans = zip(self.buffers, self.group_starts, ends, strict=True)
        return [
            (buf, st, max(lo, st), min(hi, end))
            for buf, st, end in spans
            if max(lo, st) < min(hi, end)
        ]

    def _bounds(
        self, layers: tuple[int, int] | None, heads: tuple[int, int] | None
    ) -> tuple[int, int, int, int]:
        """``layers`` and ``heads`` (default: all of this shard's) as ``lo, hi, h_lo, h_hi``."""
        kv = self.kv
        lo, hi = layers or (0, kv.num_layers)
        h_lo, h_hi = heads or (0, kv.local_heads)
        if not (0 <= lo < hi <= kv.num_layers and 0 <= h_lo < h_hi <= kv.local_heads):
            raise ValueError(f"layers {lo}:{hi} / heads {h_lo}:{h_hi} outside this pool's shard")
        return lo, hi, h_lo, h_hi

    def _page_shape(self) -> tuple[int, ...]:
        kv = self.kv
        return (kv.num_layers, kv.kv_slots, kv.page_size, kv.local_heads, kv.slot_dim)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
