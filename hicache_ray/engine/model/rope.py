"""Rotary position embeddings: inverse frequencies (with scaling) and their application.

The "halves" convention of Llama-family checkpoints: a head vector ``x`` is split into
``x1 = x[:D/2]``, ``x2 = x[D/2:]`` and rotated as ``(x1 cos - x2 sin, x2 cos + x1 sin)``,
which is what Hugging Face's ``rotate_half`` computes.
"""

from __future__ import annotations

import math

import torch

from hicache_ray.engine.model.config import ModelConfig

__all__ = ["inverse_frequencies", "rotate"]


def inverse_frequencies(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies, scaled as the config says."""
    d = config.head_dim
    base = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is not None and scaling.type == "linear":
        base = base / scaling.factor
    elif scaling is not None and scaling.type == "llama3":
        low = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low, base / scaling.factor, base)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        middle = ~(wavelen < high) * ~(wavelen > low)
        base = torch.where(middle, blended, scaled)
    return base.to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, H, D]`` with ``cos``/``sin`` ``[T, 1, D/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
