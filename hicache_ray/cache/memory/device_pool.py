"""L1: the device KV pool.

Per local layer and per slot (K and V; the latent for MLA) one tensor
``[num_tokens, local_heads, slot_dim]`` on the device (a CPU tensor when there is no GPU).
Token slot ``t`` belongs to page ``t // page_size``; the allocator hands out whole pages.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache_ray.base.layout import ShardKV
from hicache_ray.cache.memory.allocator import PageAllocator

__all__ = ["DevicePool", "default_device"]


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DevicePool:
    """Device KV tensors plus the page allocator that hands out their slots."""

    def __init__(self, kv: ShardKV, num_pages: int, device: torch.device | None = None) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.num_pages = num_pages
        self.num_tokens = num_pages * kv.page_size
        self.device = device or default_device()
        shape = (self.num_tokens, kv.local_heads, kv.slot_dim)
        # buffers[slot][layer]; slot 0 is K (or the MLA latent), slot 1 is V.
        self.buffers: list[list[torch.Tensor]] = [
            [torch.zeros(shape, dtype=kv.dtype, device=self.device) for _ in range(kv.num_layers)]
            for _ in range(kv.kv_slots)
        ]
        self.allocator = PageAllocator(num_pages, name="device pool")
        self._rows_np: list[list[np.ndarray]] | None = (
            [
                [self._numpy_rows(layer, slot) for slot in range(kv.kv_slots)]
                for layer in range(kv.num_layers)
            ]
            if self.device.type == "cpu"
            else None
        )

    @property
    def available_size(self) -> int:
        """Free token slots."""
        return self.allocator.num_free_pages * self.page_size

    @property
    def size_bytes(self) -> int:
        return self.num_pages * self.kv.page_bytes

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The slot tensors (K, V) or (latent,) of local layer ``layer``."""
        return tuple(slot[layer] for slot in self.buffers)

    def page_rows(self, layer: int, slot: int) -> torch.Tensor:
        """``[num_pages, page_elems]`` view of one layer and slot; row p is page p."""
        return self.buffers[slot][layer].view(self.num_pages, -1)

    def page_rows_bytes(self, layer: int, slot: int) -> np.ndarray:
        """Like :meth:`page_rows`, as a writable uint8 numpy view (CPU pools only)."""
        if self._rows_np is None:
            raise TypeError(f"device pool on {self.device} has no numpy view")
        return self._rows_np[layer][slot]

    def _numpy_rows(self, layer: int, slot: int) -> np.ndarray:
        return self.page_rows(layer, slot).view(torch.uint8).numpy()

    def token_indices(self, pages: list[int]) -> torch.Tensor:
        """Token slot indices of ``pages``, in order."""
        p = torch.tensor(pages, dtype=torch.int64)
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (p[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
