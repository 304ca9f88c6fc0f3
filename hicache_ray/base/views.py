"""Zero-copy byte views of tensors (host pools, page frames and staging buffers)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["byte_view"]


def byte_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (writable when the tensor is)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("a byte view needs a contiguous CPU tensor")
    array: np.ndarray = t.reshape(-1).view(torch.uint8).numpy()
    return array.data
