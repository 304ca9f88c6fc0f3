"""From what vLLM hands a KV connector to hicache-ray's shard, key plan and store.

vLLM's ``kv_connector_extra_config`` selects the store and the key namespace
(:class:`VLLMStoreOptions`); the model's KV facts come from vLLM's config and, on the
worker, from the KV cache tensors it registers. Nothing here imports vLLM: its objects are
read by attribute, so this module is tested without it.

A vLLM block is one page (``block_size`` = page size). Each attention backend keeps a
layer's blocks in its own order; :data:`BLOCK_LAYOUTS` maps a layer's cache tensor, as
vLLM registers it, to a K and a V view ``[blocks, P, H, D]``, whose block ``b`` stacked is
one layer of the stored ``page-unified-v1`` object order (``[layers, S, P, H, D]``).
Moving pages is then one gather or scatter per layer and slot (``view[block_ids]``), never
a loop over tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from hicache_ray.base.checks import check_types
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import DTYPES, ModelKV, Shard, ShardKV
from hicache_ray.base.storage_config import FileStorageOptions, RayStorageOptions, StorageConfig
from hicache_ray.engine.model.checkpoint import checkpoint_revision
from hicache_ray.keys import ShardPlan, plan_objects

__all__ = [
    "BLOCK_LAYOUTS",
    "VLLMStoreOptions",
    "slot_views",
    "layer_index",
    "parse_options",
    "rank_plan",
    "storage_config",
    "tp_suffixes",
]

# The keys vLLM itself reads from kv_connector_extra_config: none today. Keep the set so a
# key vLLM adds later is one line here, not a refused start.
VLLM_KEYS: frozenset[str] = frozenset()


def _cpu_vec_slots(layer: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU_ATTN with its ``vec`` kernels (x86 without AMX, or float32): a layer is
    allocated ``[blocks, H, P, 2D]``; per block and head the kernel writes K transposed
    (``[D, P]``: one dimension of every token, then the next) and then V (``[P, D]``).
    Found by comparing the bytes vLLM 0.32 stores with the KV hicache-ray computes."""
    blocks, heads, page, _ = layer.shape
    halves = layer.view(blocks, heads, 2, page * head_dim)
    key = halves[:, :, 0].view(blocks, heads, head_dim, page).permute(0, 3, 1, 2)
    value = halves[:, :, 1].view(blocks, heads, page, head_dim).permute(0, 2, 1, 3)
    return key, value


def _split_content_slots(layer: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION: the logical ``[blocks, H, P, 2D]`` whose
    last axis is a token's K then V (``split(head_size, dim=-1)`` in their forwards),
    whatever the physical stride order."""
    key = layer[..., :head_dim].permute(0, 2, 1, 3)
    value = layer[..., head_dim:].permute(0, 2, 1, 3)
    return key, value


SlotViews = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
# name -> (what it is verified on, K and V views of one layer's cache)
BLOCK_LAYOUTS: dict[str, tuple[str, SlotViews]] = {
    "cpu_vec": ("CPU_ATTN, vec ISA: tested on CPU", _cpu_vec_slots),
    "split_content": (
        "FLASH_ATTN / TRITON_ATTN / FLEX_ATTENTION: awaiting the GPU check",
        _split_content_slots,
    ),
}


def slot_views(
    layout: str, layer: torch.Tensor, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache as K and V views ``[blocks, P, H, D]`` (writes land in the cache;
    block ``b`` of both, stacked, is one layer of the stored ``[S, P, H, D]`` order).

    Raises:
        ConfigError: an unknown layout, or a tensor that is not ``[blocks, H, P, 2D]``.
    """
    if layout not in BLOCK_LAYOUTS:
        raise ConfigError("layout", layout, "unknown", f"use one of {sorted(BLOCK_LAYOUTS)}")
    if layer.dim() != 4 or layer.shape[1] != kv_heads or layer.shape[3] != 2 * head_dim:
        raise ConfigError(
            "kv cache",
            tuple(layer.shape),
            f"is not [blocks, {kv_heads} heads, block_size, {2 * head_dim}]",
            "use an attention backend of BLOCK_LAYOUTS (MLA and hybrid models are not supported)",
        )
    return BLOCK_LAYOUTS[layout][1](layer, head_dim)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """The decoder layer of an attention layer's name (``model.layers.7.self_attn.attn``)."""
    found = _LAYER.search(name)
    if found is None:
        raise ConfigError(
            "kv cache layer", name, "has no layers.<n> in its name", "use a decoder-only model"
        )
    return int(found.group(1))


class VLLMStoreOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """hicache-ray's keys of vLLM's ``kv_connector_extra_config``.

    Attributes:
        store: ``ray`` (pages in the Ray object store, shared cluster-wide) or ``file``
            (a directory or any ``pyarrow.fs`` URI).
        ray: options of the ray store (``name``, ``num_shards``, ``timeout_s``, ...; see
            :class:`~hicache_ray.base.storage_config.RayStorageOptions`).
        ray_address: the Ray cluster to join when this process is not connected to one yet;
            empty means ``auto``.
        file: options of the file store (``root`` is required with ``store="file"``).
        model_id: the model in the key namespace; empty means vLLM's served model name.
            Engines that share pages must agree on it.
        model_revision: the weights' revision (part of the namespace's model id); empty:
            a local checkpoint directory's weights revision, as hicache-ray deployments of
            the same directory name it.
        tenant_salt: seeds the page-hash chain of requests that carry no ``cache_salt``
            (a request's own ``cache_salt`` wins; both equal SGLang's ``cache_salt``).
        share_tp: the TP sizes of every deployment sharing the store; empty means this TP
            size alone.
        layout: how the attention backend keeps a layer's blocks (:data:`BLOCK_LAYOUTS`);
            ``auto``: ``cpu_vec`` on the CPU platform (refused for a kernel ISA whose
            layout is not verified), else ``split_content``.
        max_pending_saves: saves queued behind the store before new ones are dropped (a
            dropped save is a later miss, counted).
        load_async: load a request's pages on a background thread while vLLM runs other
            requests (it schedules the request once the load is in); ``false``: load
            in the step, placed layer by layer as the forward reaches each layer.
    """

    store: Literal["ray", "file"] = "ray"
    ray: RayStorageOptions = msgspec.field(default_factory=RayStorageOptions)
    ray_address: str = ""
    file: FileStorageOptions = msgspec.field(default_factory=FileStorageOptions)
    model_id: str = ""
    model_revision: str = ""
    tenant_salt: str = ""
    share_tp: tuple[int, ...] = ()
    layout: str = "auto"
    max_pending_saves: int = 64
    load_async: bool = True

    def __post_init__(self) -> None:
        check_types(self)
        if self.layout != "auto" and self.layout not in BLOCK_LAYOUTS:
            raise ConfigError(
                "layout", self.layout, "unknown", f"use auto or one of {sorted(BLOCK_LAYOUTS)}"
            )
        if self.max_pending_saves < 1:
            raise ConfigError("max_pending_saves", self.max_pending_saves, "below 1", "use 1+")
        if self.store == "file" and not self.file.root:
            raise ConfigError("file.root", self.file.root, "empty", "give a directory or URI")


def parse_options(extra: object) -> VLLMStoreOptions:
    """Our options from ``kv_connector_extra_config``.

    Raises:
        ConfigError: not an object, an unknown key, a value of the wrong type or range (the
            message names it and lists the accepted keys).
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", extra, "not a JSON object", "pass one")
    ours = {k: v for k, v in extra.items() if k not in VLLM_KEYS}
    try:
        return msgspec.convert(ours, VLLMStoreOptions, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(
            "kv_connector_extra_config", ours, str(exc), f"use the keys {_keys_at(str(exc))}"
        ) from None


def _keys_at(error: str) -> list[str]:
    """The keys accepted where a validation ``error`` points (``... - at `$.ray```): those
    of the nested options it names, else the top level's."""
    struct: Any = VLLMStoreOptions
    _, _, path = error.rpartition(" - at `$")
    for part in path.rstrip("`").split("."):
        nested = {f.name: f.type for f in msgspec.structs.fields(struct)}.get(part)
        if isinstance(nested, type) and issubclass(nested, msgspec.Struct):
            struct = nested
    return sorted(struct.__struct_fields__)


def model_kv(vllm_config: Any) -> tuple[ModelKV, int]:
    """The model's KV facts and the page size, from vLLM's config.

    Raises:
        ConfigError: a model or cache setting the connector cannot store (MLA, a quantized
            KV cache, a dtype with no name in the namespace, pipeline parallelism).
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    if getattr(model, "use_mla", False):
        raise ConfigError("model", model.model, "uses MLA", "use an MHA or GQA model")
    if str(cache.cache_dtype) != "auto":
        raise ConfigError("kv_cache_dtype", cache.cache_dtype, "is quantized", "use auto")
    if int(parallel.pipeline_parallel_size) != 1:
        raise ConfigError(
            "pipeline_parallel_size", parallel.pipeline_parallel_size, "not supported", "use 1"
        )
    dtype = str(model.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, "has no name in the namespace", f"use {sorted(DTYPES)}")
    kv = ModelKV(
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_dim=int(model.get_head_size()),
        dtype=dtype,  # type: ignore[arg-type]
    )
    return kv, int(cache.block_size)


def storage_config(
    options: VLLMStoreOptions, served_model: str, model_path: str = ""
) -> StorageConfig:
    """The storage settings of the connector's namespace (a worker joins the Ray cluster
    ``ray_address`` names when it opens the store). With no ``model_revision``, a local
    checkpoint directory is named by its weights' revision, as a hicache-ray deployment of
    the same directory names it, so both share its pages and another checkpoint never does."""
    address = options.ray_address or options.ray.address or "auto"
    revision = options.model_revision
    root = Path(model_path) if model_path else None
    if not revision and root is not None and (root / "config.json").is_file():
        revision = checkpoint_revision(root)
    return StorageConfig(
        backend=options.store,
        model_id=options.model_id or served_model,
        model_revision=revision,
        tenant_salt=options.tenant_salt,
        share_tp=options.share_tp,
        ray=msgspec.structs.replace(options.ray, address=address),
        file=options.file,
    )


def rank_plan(
    model: ModelKV,
    page_size: int,
    storage: StorageConfig,
    tp_rank: int,
    tp_size: int,
    layers: tuple[int, int] | None = None,
) -> ShardPlan:
    """One TP rank's objects per page (its ``[first, end)`` layers, default all)."""
    shard = Shard(tp_rank=tp_rank, tp_size=tp_size)
    kv = ShardKV(model=model, shard=shard, page_size=page_size, layers=layers)
    return plan_objects(kv, storage)


def tp_suffixes(model: ModelKV, page_size: int, storage: StorageConfig, tp_size: int) -> list[str]:
    """The key suffixes of one page across every TP rank: a page is a hit for vLLM only
    when every rank's objects are stored."""
    plans = [rank_plan(model, page_size, storage, r, tp_size) for r in range(tp_size)]
    return list(dict.fromkeys(obj.suffix for plan in plans for obj in plan.objects))
