"""What a model is: its architecture, sizes and where its weights come from.

One :class:`ModelConfig` describes both the seeded random presets (tests, the demo and the
benchmarks: weights drawn from ``seed``) and real Hugging Face checkpoints (``checkpoint``
names the directory; :func:`hicache_ray.engine.model.checkpoint.load_config` fills the rest from
its ``config.json``). Every supported family is a pre-norm decoder with RMSNorm, rotary
embeddings, grouped-query attention and a SwiGLU MLP; they differ in QKV biases (Qwen2),
per-head q/k norms (Qwen3), the head dimension and RoPE scaling.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from hicache_ray.base.checks import check_choice, check_not_negative, check_positive, check_types
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import DTypeName, ModelKV

__all__ = ["ARCHITECTURES", "PRESETS", "ModelConfig", "RopeScaling", "preset"]

Architecture = Literal["llama", "mistral", "qwen2", "qwen3"]
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
RopeType = Literal["linear", "llama3"]


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    """Rotary frequency scaling (Hugging Face's ``rope_scaling`` / ``rope_parameters``).

    Attributes:
        type: ``linear`` (every frequency divided by ``factor``) or ``llama3`` (low
            frequencies divided by ``factor``, high ones kept, a smooth ramp between).
        factor: the scaling factor.
        low_freq_factor, high_freq_factor, original_max_position_embeddings: ``llama3``.
    """

    type: RopeType
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        check_choice("rope_scaling.type", self.type, RopeType)
        check_types(self, "rope_scaling.")
        check_positive("rope_scaling.factor", self.factor)
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ConfigError(
                "rope_scaling.high_freq_factor",
                self.high_freq_factor,
                f"must exceed low_freq_factor={self.low_freq_factor} (both positive)",
                "use the checkpoint's values",
            )


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

    Attributes:
        name: preset name, or the checkpoint's directory name.
        architecture: ``llama``, ``mistral``, ``qwen2`` (QKV biases) or ``qwen3`` (per-head
            q/k RMSNorm).
        vocab_size: tokens in the vocabulary.
        hidden_size: width of the residual stream.
        num_layers: decoder layers.
        num_heads: attention (query) heads.
        num_kv_heads: KV heads (grouped-query attention: they divide ``num_heads``).
        head_dim: dimension of one head.
        intermediate_size: width of the SwiGLU MLP.
        rope_theta: rotary base.
        rope_scaling: rotary frequency scaling (Llama 3 and linear), or None.
        rms_eps: RMSNorm epsilon.
        qkv_bias: the q/k/v projections have biases (Qwen2).
        qk_norm: q and k are RMS-normalized per head before the rotary embedding (Qwen3).
        tie_embeddings: the output projection reuses the embedding matrix (with random
            weights that makes greedy decoding repeat the input token: off in presets).
        max_position_embeddings: longest context (0: unbounded); longer requests are
            refused.
        sliding_window: attention window of Mistral-style checkpoints (0: none); requests
            longer than it are refused (attention here is always over the whole context).
        eos_token_ids: tokens that end generation (empty for the random presets).
        dtype: ``float32`` (exactness tests), ``bfloat16`` or ``float16``.
        seed: random weights are drawn from this seed, identically in every process.
        checkpoint: a Hugging Face model directory (``config.json`` + safetensors); empty
            for seeded random weights.
        revision: identifies the checkpoint's files (a hash of their headers and sampled
            bytes): part of the L3 namespace, so two checkpoints never share pages.
    """

    name: str = "custom"
    architecture: Architecture = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 0
    sliding_window: int = 0
    eos_token_ids: tuple[int, ...] = ()
    dtype: DTypeName = "float32"
    seed: int = 0
    checkpoint: str = ""
    revision: str = ""

    def __post_init__(self) -> None:
        check_choice("architecture", self.architecture, Architecture)
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
        check_not_negative("max_position_embeddings", self.max_position_embeddings)
        check_not_negative("sliding_window", self.sliding_window)
        for token in self.eos_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ConfigError(
                    "eos_token_ids",
                    token,
                    f"outside the vocabulary [0, {self.vocab_size})",
                    "fix it",
                )
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

    @property
    def max_context(self) -> int:
        """Most tokens one request may hold (prompt + generated); 0 for unbounded."""
        limits = [n for n in (self.max_position_embeddings, self.sliding_window) if n]
        return min(limits, default=0)

    def model_kv(self) -> ModelKV:
        """The KV facts the cache needs for this model."""
        return ModelKV(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
        )


PRESETS: dict[str, ModelConfig] = {
    # Tests: a few milliseconds per prefill. Seeded random weights (they produce token ids,
    # not text: use a checkpoint for that).
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
            "model", name, "unknown preset", f"use one of {sorted(PRESETS)} or a checkpoint path"
        ) from None
    return msgspec.structs.replace(base, **overrides)
