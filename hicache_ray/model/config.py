"""Sizes of the reference model, by name."""

from __future__ import annotations

import msgspec

from hicache_ray.checks import check_positive, check_types
from hicache_ray.errors import ConfigError
from hicache_ray.layout import DTypeName, ModelKV

__all__ = ["PRESETS", "ModelConfig", "preset"]


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

    Attributes:
        name: preset name (informational).
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
        intermediate_size: the shapes.
        rope_theta: rotary base.
        rms_eps: RMSNorm epsilon.
        tie_embeddings: the output projection reuses the embedding matrix (with random
            weights that makes greedy decoding repeat the input token: off by default).
        dtype: ``float32`` (default; exactness tests), ``bfloat16`` or ``float16``.
        seed: weights are drawn from this seed, identically in every process.
    """

    name: str = "custom"
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    dtype: DTypeName = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        for field in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            check_positive(field, getattr(self, field))
        check_positive("rope_theta", self.rope_theta)
        check_positive("rms_eps", self.rms_eps)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "num_heads",
                self.num_heads,
                f"not a multiple of num_kv_heads={self.num_kv_heads}",
                "use a whole number of query heads per KV head",
            )
        if self.head_dim % 2:
            raise ConfigError("head_dim", self.head_dim, "odd", "rotary embeddings need pairs")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("dtype", self.dtype, "unsupported", "use float32, bfloat16, float16")

    def model_kv(self) -> ModelKV:
        """The KV facts the cache needs for this model."""
        return ModelKV(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
        )


PRESETS: dict[str, ModelConfig] = {
    # Tests: a few milliseconds per prefill.
    "tiny": ModelConfig(name="tiny"),
    # tiny with four KV heads: deployments of TP 1, 2 and 4 (smoke runs of the demo)
    "tiny4": ModelConfig(name="tiny4", num_heads=4, num_kv_heads=4),
    # Benchmarks: a 2,000-token prefill takes on the order of a second on a 2-core CPU, so
    # recomputing a prompt costs what it costs in serving, relative to moving its KV.
    "bench": ModelConfig(
        name="bench",
        vocab_size=8192,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1408,
    ),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """A named size, optionally with fields replaced (``dtype="bfloat16"``)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ConfigError(
            "model", name, "unknown preset", f"use one of {sorted(PRESETS)}"
        ) from None
    return msgspec.structs.replace(base, **overrides)
