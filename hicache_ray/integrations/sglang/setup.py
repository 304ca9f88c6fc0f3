"""From what SGLang hands a storage backend to hicache-ray's shard, key plan and store.

SGLang's ``HiCacheStorageConfig`` carries the rank (TP/PP ranks and sizes, MLA or not, the
model name, ``tp_lcm_size`` and the whole ``extra_config``) but no dtype, page size, head
count or layer range: those are read from the host pool it registers. Nothing here imports
SGLang; both objects are read by attribute.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec
import torch

from hicache_ray.base.checks import check_types
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import DTYPES, ModelKV, Shard, ShardKV
from hicache_ray.base.storage_config import FileStorageOptions, RayStorageOptions, StorageConfig
from hicache_ray.integrations.sglang.host_layouts import HostGeometry, buffer_shape

__all__ = [
    "SGLANG_KEYS",
    "SGLangStoreOptions",
    "host_geometry",
    "parse_options",
    "shard_of",
]

log = logging.getLogger(__name__)

# Keys of extra_config that SGLang itself reads (the dynamic-backend loader, the zero-copy
# switch, prefetch tuning): accepted and left to SGLang.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
# Keys SGLang adds to every backend's extra_config on its own (``--file-storage-path`` adds
# ``file_storage_path``): accepted, logged and ignored (they configure SGLang's file backend).
SGLANG_ADDED_KEYS = frozenset({"file_storage_path"})


class SGLangStoreOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """hicache-ray's keys of SGLang's ``--hicache-storage-backend-extra-config``.

    Attributes:
        store: ``ray`` (pages in the Ray object store, shared cluster-wide) or ``file``
            (a directory or any ``pyarrow.fs`` URI).
        ray: options of the ray store (``name``, ``num_shards``, ``capacity_bytes``,
            ``timeout_s``, ...; see :class:`~hicache_ray.base.storage_config.RayStorageOptions`).
        ray_address: the Ray cluster to join when this process is not connected to one yet;
            empty means ``auto`` (the cluster of this node, started with ``ray start``).
        file: options of the file store (``root`` is required with ``store="file"``).
        model_id: the model in the key namespace; empty means SGLang's model name (the
            served model name or path). Deployments that share pages must agree on it.
        model_revision: the weights' revision; it becomes part of the namespace's model id
            (``{model_id}@{revision}``), as in hicache-ray deployments.
        share_tp: the TP sizes of every deployment (SGLang or hicache-ray) sharing the
            store; empty falls back to SGLang's ``tp_lcm_size``, then to this TP size alone.
        share_pp: the PP sizes sharing the store; empty means this PP split alone.
        num_layers: the model's decoder layers; needed with ``share_pp`` on any stage but
            the last (the pool only knows its own layers).
    """

    store: Literal["ray", "file"] = "ray"
    ray: RayStorageOptions = msgspec.field(default_factory=RayStorageOptions)
    ray_address: str = ""
    file: FileStorageOptions = msgspec.field(default_factory=FileStorageOptions)
    model_id: str = ""
    model_revision: str = ""
    share_tp: tuple[int, ...] = ()
    share_pp: tuple[int, ...] = ()
    num_layers: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        if self.num_layers < 0:
            raise ConfigError("num_layers", self.num_layers, "negative", "give the model's layers")


def parse_options(extra: object) -> SGLangStoreOptions:
    """Our options from ``extra_config`` (SGLang's own keys are skipped).

    Raises:
        ConfigError: an unknown key, a value of the wrong type or range (the message names
            it and lists the accepted keys).
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConfigError("extra_config", extra, "not a JSON object", "pass a JSON object")
    if "tenant_salt" in extra:
        raise ConfigError(
            "tenant_salt",
            extra["tenant_salt"],
            "SGLang seeds page hashes per request, before they reach the backend",
            "send cache_salt with each SGLang request; it equals a hicache-ray deployment's "
            "tenant_salt, so both name the same pages",
        )
    for key in SGLANG_ADDED_KEYS & set(extra):
        log.info(
            "hicache-ray: ignoring extra_config[%r] (SGLang adds it for its own file backend)", key
        )
    ours = {k: v for k, v in extra.items() if k not in SGLANG_KEYS | SGLANG_ADDED_KEYS}
    try:
        return msgspec.convert(ours, SGLangStoreOptions, strict=True)
    except msgspec.ValidationError as exc:
        accepted = sorted(SGLangStoreOptions.__struct_fields__)
        raise ConfigError(
            "hicache_storage_backend_extra_config",
            ours,
            str(exc),
            f"use the keys {accepted} (and SGLang's own {sorted(SGLANG_KEYS)})",
        ) from None


def host_geometry(pool: Any, is_mla: bool) -> HostGeometry:
    """The geometry of an SGLang host pool (``MHATokenToKVPoolHost`` or
    ``MLATokenToKVPoolHost``), checked against its ``kv_buffer``.

    Raises:
        ConfigError: a pool this backend cannot address (another kind, another layout, a
            dtype with no name in the namespace, a buffer of an unexpected shape).
    """
    layout = getattr(pool, "layout", None)
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        raise ConfigError(
            "host pool", type(pool).__name__, "has no kv_buffer tensor", "use an MHA or MLA pool"
        )
    try:
        geometry = HostGeometry(
            layout=str(layout),
            is_mla=is_mla,
            page_size=int(pool.page_size),
            layers=int(pool.layer_num),
            heads=1 if is_mla else int(pool.head_num),
            head_dim=int(pool.kv_cache_dim if is_mla else pool.head_dim),
            head_groups=int(getattr(pool, "head_group_num", 1) or 1) if not is_mla else 1,
        )
    except (AttributeError, ValueError) as exc:
        raise ConfigError(
            "host pool", type(pool).__name__, str(exc), "use an MHA or MLA token pool"
        ) from None
    expected = buffer_shape(geometry, int(pool.size) // geometry.page_size)
    if tuple(buffer.shape) != expected or buffer.device.type != "cpu":
        raise ConfigError(
            "host pool",
            type(pool).__name__,
            f"kv_buffer is {tuple(buffer.shape)} on {buffer.device}, expected {expected} on cpu",
            "use SGLang 0.5.23's host pools",
        )
    if dtype_name(buffer.dtype) not in DTYPES:
        raise ConfigError(
            "host pool dtype", buffer.dtype, "has no name in the namespace", f"use {sorted(DTYPES)}"
        )
    return geometry


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (SGLang's ``normalize_dtype``)."""
    return str(dtype).removeprefix("torch.")


def _num_layers(config: Any, options: SGLangStoreOptions, start: int, end: int) -> int:
    """The model's decoder layers: given, or known on the last stage (its end); a stage
    before the last assumes at least one layer per stage after it (no ``share_pp``)."""
    last_stage = config.pp_rank == config.pp_size - 1
    num_layers = options.num_layers or (end if last_stage else 0)
    if options.num_layers and (end > num_layers or (last_stage and end != num_layers)):
        raise ConfigError(
            "num_layers",
            options.num_layers,
            f"contradicts this stage's layers {start}..{end - 1}",
            "give the model's decoder layers",
        )
    if not num_layers:
        if options.share_pp:
            raise ConfigError(
                "num_layers",
                0,
                "unknown on a stage before the last, and share_pp needs it",
                "add num_layers (the model's decoder layers) to extra_config",
            )
        num_layers = end + (config.pp_size - 1 - config.pp_rank)
    return num_layers


def shard_of(
    config: Any, pool: Any, geometry: HostGeometry, options: SGLangStoreOptions
) -> tuple[ShardKV, StorageConfig]:
    """This rank's KV shard and the storage settings of its namespace.

    Raises:
        ConfigError: the model has no name, the pool's layers contradict ``num_layers``, or
            the sharing declaration does not fit the model.
    """
    if getattr(config, "dcp_size", 1) > 1:
        raise ConfigError(
            "dcp_size", config.dcp_size, "decode context parallelism splits pages", "use 1"
        )
    start, end = int(pool.start_layer), int(pool.end_layer)
    if end - start != geometry.layers:
        raise ConfigError(
            "host pool", (start, end), f"holds {geometry.layers} layers", "use SGLang 0.5.23"
        )
    num_layers = _num_layers(config, options, start, end)
    model = ModelKV(
        num_layers=num_layers,
        num_kv_heads=geometry.heads * (1 if geometry.is_mla else config.tp_size),
        head_dim=geometry.head_dim,
        dtype=dtype_name(pool.kv_buffer.dtype),  # type: ignore[arg-type]
        kv_lora_rank=geometry.head_dim if geometry.is_mla else 0,
    )
    shard = Shard(
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        attn_cp_rank=config.attn_cp_rank,
        attn_cp_size=config.attn_cp_size,
    )
    kv = ShardKV(model=model, shard=shard, page_size=geometry.page_size, layers=(start, end))
    share_tp = options.share_tp
    if not share_tp and config.tp_lcm_size:  # SGLang checked that tp_size divides it
        share_tp = tuple(sorted({int(config.tp_lcm_size), config.tp_size}))
    # A process SGLang started joins the cluster when it opens the store.
    address = options.ray_address or options.ray.address or "auto"
    storage = StorageConfig(
        backend=options.store,
        model_id=options.model_id or str(config.model_name or ""),
        model_revision=options.model_revision,
        share_tp=share_tp,
        share_pp=options.share_pp,
        ray=msgspec.structs.replace(options.ray, address=address),
        file=options.file,
    )
    return kv, storage
