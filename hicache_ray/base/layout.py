"""KV facts of a model and of one rank's shard, and the page arithmetic built on them.

A shard is a (tp_rank, tp_size, pp_rank, pp_size) slice of the model: tensor parallelism
splits KV heads, pipeline parallelism splits layers into contiguous ranges. MLA models keep
one latent vector per token and layer, replicated on every TP rank.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from hicache_ray.base.checks import check_types
from hicache_ray.base.config import CacheConfig
from hicache_ray.base.errors import ConfigError

__all__ = [
    "DTYPES",
    "ModelKV",
    "Shard",
    "ShardKV",
    "host_pool_pages",
    "stage_layers",
    "torch_dtype",
]

DTypeName = Literal["float32", "float16", "bfloat16", "float8_e4m3fn"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a logical dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError("dtype", name, "unknown dtype", f"use one of {sorted(DTYPES)}") from None


class ModelKV(msgspec.Struct, frozen=True, kw_only=True):
    """What one token's KV looks like for the whole model.

    Attributes:
        num_layers: decoder layers.
        num_kv_heads: total KV heads (ignored for MLA).
        head_dim: dimension of one KV head.
        dtype: logical dtype name of the cache.
        kv_lora_rank: MLA latent rank; 0 for MHA/GQA.
        qk_rope_head_dim: MLA rotary part stored beside the latent.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DTypeName = "float16"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be positive", "set it above 0")
        if self.kv_lora_rank < 0 or self.qk_rope_head_dim < 0:
            raise ConfigError("kv_lora_rank", self.kv_lora_rank, "negative", "use 0 for MHA")
        torch_dtype(self.dtype)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=torch_dtype(self.dtype)).element_size()


class Shard(msgspec.Struct, frozen=True, kw_only=True):
    """Coordinates of one rank; rank = pp_rank * tp_size + tp_rank.

    ``attn_cp_rank`` / ``attn_cp_size`` describe attention context parallelism (each rank
    holds the KV of a slice of the tokens) for engines that run it; only the
    ``rank-suffix`` key scheme can name such pages.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1

    def __post_init__(self) -> None:
        check_types(self)
        for size, rank in (
            ("tp_size", "tp_rank"),
            ("pp_size", "pp_rank"),
            ("attn_cp_size", "attn_cp_rank"),
        ):
            if getattr(self, size) <= 0:
                raise ConfigError(size, getattr(self, size), "must be positive", "use 1 or more")
            if not 0 <= getattr(self, rank) < getattr(self, size):
                raise ConfigError(
                    rank, getattr(self, rank), f"outside [0, {size})", f"use 0..{size} - 1"
                )

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


class ShardKV(msgspec.Struct, frozen=True, kw_only=True):
    """The KV one rank holds: its heads and layers, and the byte sizes that follow.

    ``kv_slots`` is 2 (K and V) for MHA/GQA and 1 (the latent) for MLA; ``local_heads`` and
    ``slot_dim`` describe one slot of one token of one layer. ``layers`` pins this stage's
    ``[first, end)`` layers when another engine split the model (default: our split).
    """

    model: ModelKV
    shard: Shard
    page_size: int
    layers: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_types(self)
        m, s = self.model, self.shard
        if not m.is_mla and m.num_kv_heads % s.tp_size:
            raise ConfigError(
                "tp_size",
                s.tp_size,
                f"does not divide num_kv_heads={m.num_kv_heads}",
                "use a TP size that divides the KV heads",
            )
        if s.pp_size > m.num_layers:
            raise ConfigError(
                "pp_size",
                s.pp_size,
                f"more stages than num_layers={m.num_layers}",
                "use at most one stage per layer",
            )

    @property
    def kv_slots(self) -> int:
        return 1 if self.model.is_mla else 2

    @property
    def local_heads(self) -> int:
        return 1 if self.model.is_mla else self.model.num_kv_heads // self.shard.tp_size

    @property
    def first_head(self) -> int:
        return 0 if self.model.is_mla else self.shard.tp_rank * self.local_heads

    @property
    def slot_dim(self) -> int:
        m = self.model
        return m.kv_lora_rank + m.qk_rope_head_dim if m.is_mla else m.head_dim

    @property
    def layer_range(self) -> tuple[int, int]:
        """[first, end) layers of this PP stage (see :func:`stage_layers`)."""
        if self.layers is not None:
            return self.layers
        return stage_layers(self.model.num_layers, self.shard.pp_size, self.shard.pp_rank)

    @property
    def num_layers(self) -> int:
        first, end = self.layer_range
        return end - first

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.model.dtype)

    @property
    def token_slot_bytes(self) -> int:
        """Bytes of one token, one layer, one slot (K or V)."""
        return self.local_heads * self.slot_dim * self.model.itemsize

    @property
    def page_layer_bytes(self) -> int:
        """Bytes of one page of one layer, all slots."""
        return self.kv_slots * self.page_size * self.token_slot_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all of this rank's layers."""
        return self.num_layers * self.page_layer_bytes


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[first, end) layers of stage ``pp_rank`` of ``pp_size``: an even split whose last
    ``num_layers % pp_size`` stages take one layer more (SGLang's ``get_pp_indices``, so
    both engines cut a model at the same layers)."""
    base, extra = divmod(num_layers, pp_size)
    short = pp_size - extra  # stages with ``base`` layers; the rest have one more
    first = pp_rank * base + max(0, pp_rank - short)
    return first, first + base + (1 if pp_rank >= short else 0)


def host_pool_pages(
    config: CacheConfig,
    kv: ShardKV,
    budget_bytes: int | None = None,
    *,
    device_in_host_memory: bool = False,
) -> int:
    """Pages of the host pool for ``config``, within ``budget_bytes`` when given.

    With a GPU device the host pool alone is capped by the budget. When the device pool
    also lives in host memory (``device_in_host_memory``: a CPU device), both pools must
    fit the budget together, and a configuration that does not is refused rather than
    capped: it names both sizes and the budget.

    Raises:
        ConfigError: the pools do not fit the budget (CPU device); under write_through the
            host pool would not be larger than the device pool (no room for L3 hits); or
            it has no room for one page.
    """
    mem = config.memory
    device_pages = mem.num_device_pages
    if mem.hicache_size_bytes:
        pages = mem.hicache_size_bytes // kv.page_bytes
        field, value = "hicache_size_bytes", float(mem.hicache_size_bytes)
    else:
        pages = int(device_pages * mem.hicache_ratio)
        field, value = "hicache_ratio", mem.hicache_ratio
    if budget_bytes is not None and device_in_host_memory:
        device_bytes, host_bytes = device_pages * kv.page_bytes, pages * kv.page_bytes
        if device_bytes + host_bytes > budget_bytes:
            raise ConfigError(
                "device_tokens",
                mem.device_tokens,
                f"on a CPU device both pools live in host memory: device pool {device_bytes} "
                f"bytes + host pool {host_bytes} bytes exceed the host memory budget of "
                f"{budget_bytes} bytes",
                "lower device_tokens or hicache_ratio / hicache_size_bytes, or raise "
                "host_budget_bytes if the machine has the memory",
            )
    elif budget_bytes is not None and pages * kv.page_bytes > budget_bytes:
        pages = budget_bytes // kv.page_bytes
        field, value = "host memory budget (bytes)", float(budget_bytes)
    if pages <= 0:
        raise ConfigError(
            field, value, f"leaves no room for one page of {kv.page_bytes} bytes", "raise it"
        )
    if config.write.policy == "write_through" and pages <= device_pages:
        raise ConfigError(
            field,
            value,
            f"gives {pages} host pages for {device_pages} device pages; under write_through "
            "the host tier mirrors the device tier, so there is no room for L3 hits",
            "make the host pool larger than the device pool, or use write_back",
        )
    return pages
