"""The reference model: a small Llama-style decoder that reads and writes KV in the pools."""

from hicache_ray.engine.model.attention import paged_attention, position_slots
from hicache_ray.engine.model.config import PRESETS, ModelConfig, preset
from hicache_ray.engine.model.transformer import ReferenceModel, TPGroup, gloo_tp_all_reduce

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ReferenceModel",
    "TPGroup",
    "gloo_tp_all_reduce",
    "paged_attention",
    "position_slots",
    "preset",
]
