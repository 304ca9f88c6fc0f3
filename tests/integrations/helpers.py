"""SGLang host pools and backends on CPU, built the way SGLang builds them, and a known KV.

Every element of the KV is a function of its global coordinates (layer, head, token of the
sequence, K/V slot, dim), exact in float32, so any rank of any TP / PP size and layout knows
what each byte of its pool must be. Pools are filled and read through the shapes of SGLang's
own ``get_data_page(flat=False)`` (one page in the layout's order), not through our views.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache_ray.integrations.sglang.backend import HiCacheRayStorage

PAGE = 4
HEADS = 8  # MHA KV heads of the whole model
LAYERS = 4
HEAD_DIM = 4
LATENT = 16  # MLA kv_cache_dim (page_unified rows are multiples of 16 bytes)
POOL_TOKENS = 64
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")


def host_pool(
    tp: int,
    layout: str,
    *,
    mla: bool = False,
    layers: tuple[int, int] = (0, LAYERS),
    dtype: torch.dtype = torch.float32,
    head_groups: int = 1,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
) -> Any:
    """A real SGLang host pool of one rank of a model of ``heads`` KV heads
    (``head_groups`` for ``page_unified``)."""
    start, end = layers
    common: dict[str, Any] = {
        "size": POOL_TOKENS,
        "page_size": PAGE,
        "dtype": dtype,
        "layer_num": end - start,
        "device": "cpu",
        "enable_memory_saver": False,
        "start_layer": start,
        "end_layer": end,
    }
    host: dict[str, Any] = {
        "pin_memory": False,
        "device": "cpu",
        "device_capacity_tokens": POOL_TOKENS,
        "start_layer": start,
        "end_layer": end,
    }
    if mla:
        dev = MLATokenToKVPool(kv_lora_rank=LATENT - 4, qk_rope_head_dim=4, **common)
        info = dev._mla_buffer_info()
        return MLATokenToKVPoolHost(
            info, 2.0, 0, PAGE, layout, target_layer_num=end - start, **host
        )
    dev = MHATokenToKVPool(head_num=heads // tp, head_dim=head_dim, **common)
    return MHATokenToKVPoolHost(
        dev._mha_buffer_info(), 2.0, 0, PAGE, layout, head_group_num=head_groups, **host
    )


def storage_config(
    extra: dict[str, Any],
    *,
    tp_rank: int = 0,
    tp: int = 1,
    pp_rank: int = 0,
    pp: int = 1,
    mla: bool = False,
    v1: bool = True,
    model: str | None = "sgl/test-model",
    tp_lcm_size: int | None = None,
) -> HiCacheStorageConfig:
    full = {
        "backend_name": "hicache-ray",
        "module_path": "hicache_ray.integrations.sglang",
        "class_name": "HiCacheRayStorage",
        "interface_v1": int(v1),
        **extra,
    }
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp,
        pp_rank=pp_rank,
        pp_size=pp,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=False,
        model_name=model,
        tp_lcm_size=tp_lcm_size,
        extra_config=full,
    )


def attach(config: HiCacheStorageConfig, pool: Any) -> HiCacheRayStorage:
    """What SGLang's cache controller does: the factory, then ``register_mem_pool_host``."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    assert isinstance(backend, HiCacheRayStorage)
    return backend


def expected(
    tokens: list[int],
    layers: tuple[int, int],
    heads: tuple[int, int],
    *,
    mla: bool = False,
) -> torch.Tensor:
    """``[L, S, P, H, D]`` of one page of ``tokens`` (global coordinates), float32."""
    layer = torch.arange(*layers).view(-1, 1, 1, 1, 1)
    slots = 1 if mla else 2
    slot = torch.arange(slots).view(1, -1, 1, 1, 1)
    token = torch.tensor(tokens).view(1, 1, -1, 1, 1)
    head = torch.arange(*heads).view(1, 1, 1, -1, 1)
    dim = torch.arange(LATENT if mla else HEAD_DIM).view(1, 1, 1, 1, -1)
    value = (((layer * 16 + head) * 2 + slot) * 4096 + token) * 16 + dim
    return value.to(torch.float32)


def native_page(pool: Any, page: int) -> torch.Tensor:
    """One page of ``pool`` as SGLang lays it out, as a view (see the module docstring)."""
    if pool.layout == "page_unified":
        return pool.kv_buffer[page]
    return pool.get_data_page(page * PAGE, flat=False)


def to_native(pool: Any, page_kv: torch.Tensor) -> torch.Tensor:
    """``[L, S, P, H, D]`` in the order of :func:`native_page` (SGLang's reshape lines)."""
    layout, kv = pool.layout, page_kv
    if kv.shape[1] == 1:  # MLA: drop the slot axis
        latent = kv[:, 0]  # [L, P, 1, D]
        return {
            "layer_first": latent,
            "page_first": latent.permute(1, 0, 2, 3),
            "page_first_direct": latent.unsqueeze(0),
            "page_unified": latent[:, :, 0],
        }[layout]
    if layout == "layer_first":
        return kv.permute(1, 0, 2, 3, 4)  # [2, L, P, H, D]
    if layout == "page_first":
        return kv.permute(1, 2, 0, 3, 4)  # [2, P, L, H, D]
    if layout == "page_first_direct":
        return kv.permute(1, 0, 2, 3, 4).unsqueeze(1)  # [2, 1, L, P, H, D]
    if layout == "page_head":
        return kv.permute(1, 3, 2, 0, 4).unsqueeze(1)  # [2, 1, H, P, L, D]
    groups = pool.head_group_num
    n, s, p, h, d = kv.shape
    return kv.reshape(n, s, p, groups, h // groups, d).permute(
        3, 0, 1, 2, 4, 5
    )  # [G, L, 2, P, Hg, D]


def fill(pool: Any, page: int, page_kv: torch.Tensor) -> None:
    native_page(pool, page).copy_(to_native(pool, page_kv.to(pool.kv_buffer.dtype)))


def page_matches(pool: Any, page: int, page_kv: torch.Tensor) -> bool:
    return torch.equal(native_page(pool, page), to_native(pool, page_kv.to(pool.kv_buffer.dtype)))
