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

from hicache_ray.config import MemLayout
from hicache_ray.layout import ShardKV
from hicache_ray.memory.allocator import PageAllocator

__all__ = ["HostPool"]


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    array: np.ndarray = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array.data)


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

    def get_page_bytes(self, page: int) -> memoryview:
        """The bytes of ``page`` in storage order ``[L, S, P, H, D]``.

        Zero-copy for ``page_first`` and single-group ``page_first_direct`` (the view is
        only valid while the page stays allocated); a gathered copy otherwise.
        """
        if len(self.buffers) == 1 and self.layout != "layer_first":
            return _bytes_view(self.buffers[0][page])
        out = torch.empty(self._page_shape(), dtype=self.kv.dtype)
        for layer in range(self.kv.num_layers):
            for slot in range(self.kv.kv_slots):
                out[layer, slot].view(-1).copy_(self._rows[layer][slot][page])
        return _bytes_view(out)

    def set_page_bytes(self, page: int, data: bytes | memoryview | np.ndarray) -> None:
        """Copy one page's storage-order bytes into ``page``."""
        raw = np.frombuffer(data, dtype=np.uint8)
        src = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
        if src.numel() != self.kv.page_bytes:
            raise ValueError(f"page payload has {src.numel()} bytes, expected {self.kv.page_bytes}")
        src = src.view(self.kv.dtype).view(self._page_shape())
        for layer in range(self.kv.num_layers):
            for slot in range(self.kv.kv_slots):
                self._rows[layer][slot][page].copy_(src[layer, slot].reshape(-1))

    def _page_shape(self) -> tuple[int, ...]:
        kv = self.kv
        return (kv.num_layers, kv.kv_slots, kv.page_size, kv.local_heads, kv.slot_dim)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
