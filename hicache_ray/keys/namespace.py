"""The L3 key namespace (SGLang's unified scheme) and the sharing grid it is built on.

Everything that must match for two ranks' KV bytes to be interchangeable is a field of
:class:`KVCacheNamespace`, which mirrors ``sglang.srt.mem_cache.hicache_key_scheme``
(0.5.23) field for field: the same facts give the same digest and so the same key names,
whether a page was stored by a hicache-ray deployment or by SGLang through our storage
backend. A rank that finds a foreign digest in a page header treats the page as a miss.

The grid is a fleet agreement (docs/storage.md, "Sharing"): the KV heads per object
(``head_group``) follow from the TP sizes that share the store, the layers per object
(``layer_partition``) from the PP splits. :func:`sharing_grid` derives both from
``StorageConfig.share_tp`` / ``share_pp`` and refuses declarations the model cannot tile.
"""

from __future__ import annotations

import hashlib
import math
from functools import reduce

import msgspec

from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import ModelKV, stage_layers
from hicache_ray.base.storage_config import StorageConfig

__all__ = [
    "NAMESPACE_SCHEMA_VERSION",
    "OBJECT_LAYOUT",
    "Grid",
    "KVCacheNamespace",
    "describe_sharing",
    "make_namespace",
    "sharing_grid",
]

NAMESPACE_SCHEMA_VERSION = 1
# The byte order of a stored object: per layer, K then V, then tokens, heads, head dim.
# SGLang's name for it (``pool_host/page_unified.py``); our pools' object views
# ``[L, S, P, H, D]`` are exactly this order.
OBJECT_LAYOUT = "page-unified-v1"


class KVCacheNamespace(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Frozen identity of one shared L3 keyspace (SGLang's struct: same fields, same order).

    Field names and order are part of the msgpack encoding that the digest hashes: do not
    reorder or rename them.

    Attributes:
        schema_version: bumped when the meaning of any field changes.
        model_id: which weights produced the KV (``{model}@{revision}`` when a revision
            is set, see :attr:`StorageConfig.namespace_model_id`).
        dtype: logical dtype of the stored KV (``float16``, ``bfloat16``, ...).
        page_size: tokens per page.
        rank_replicated: every TP rank holds the same KV (MLA); one copy is stored.
        total_kv_heads: KV heads of the whole model (0 for MLA).
        layer_partition: layers per object; 0 means each stage's own layer range.
        head_group: KV heads per object (0 for MLA).
        object_layout: byte order inside an object.
    """

    schema_version: int = NAMESPACE_SCHEMA_VERSION
    model_id: str
    dtype: str
    page_size: int
    rank_replicated: bool
    total_kv_heads: int
    layer_partition: int = 0
    head_group: int
    object_layout: str

    @property
    def digest(self) -> str:
        """``ukv1-`` + 16 hex of SHA-256 over the msgpack encoding (stable everywhere)."""
        encoded = msgspec.msgpack.encode(self)
        return f"ukv{NAMESPACE_SCHEMA_VERSION}-{hashlib.sha256(encoded).hexdigest()[:16]}"


class Grid(msgspec.Struct, frozen=True, kw_only=True):
    """The sharing grid: KV heads per object and layers per object (0: per stage)."""

    head_group: int
    layer_partition: int


def _stage_starts(num_layers: int, pp_size: int) -> list[int]:
    return [stage_layers(num_layers, pp_size, r)[0] for r in range(pp_size)]


def sharing_grid(model: ModelKV, tp_size: int, pp_size: int, storage: StorageConfig) -> Grid:
    """The grid a ``tp_size`` x ``pp_size`` deployment of ``model`` stores its pages on.

    Raises:
        ConfigError: the declaration leaves out this deployment's own sizes, or the model
            cannot be cut into the grid it implies (the message says what to change).
    """
    if model.is_mla:
        head_group = 0
    elif storage.share_tp:
        if tp_size not in storage.share_tp:
            raise ConfigError(
                "share_tp",
                storage.share_tp,
                f"leaves out this deployment's tp_size={tp_size}",
                f"add {tp_size} to share_tp",
            )
        lcm = reduce(math.lcm, storage.share_tp)
        if model.num_kv_heads % lcm:
            raise ConfigError(
                "share_tp",
                storage.share_tp,
                f"needs the model's KV heads cut into {lcm} equal groups, but it has "
                f"{model.num_kv_heads}",
                "share only with TP sizes whose least common multiple divides the KV heads",
            )
        head_group = model.num_kv_heads // lcm
    else:
        if model.num_kv_heads % tp_size:
            raise ConfigError(
                "tp_size",
                tp_size,
                f"does not divide num_kv_heads={model.num_kv_heads}",
                "use a TP size that divides the KV heads",
            )
        head_group = model.num_kv_heads // tp_size
    if not storage.share_pp:
        return Grid(head_group=head_group, layer_partition=0)
    if pp_size not in storage.share_pp:
        raise ConfigError(
            "share_pp",
            storage.share_pp,
            f"leaves out this deployment's pp_size={pp_size}",
            f"add {pp_size} to share_pp",
        )
    too_many = [p for p in storage.share_pp if p > model.num_layers]
    if too_many:
        raise ConfigError(
            "share_pp",
            storage.share_pp,
            f"PP sizes {too_many} exceed the model's {model.num_layers} layers",
            "share only with PP sizes of at most one stage per layer",
        )
    starts = [s for p in storage.share_pp for s in _stage_starts(model.num_layers, p) if s]
    # Every stage of every split starts on the grid; only the model's last chunk may be short.
    partition = reduce(math.gcd, starts) if starts else 0
    return Grid(head_group=head_group, layer_partition=partition)


def describe_sharing(model: ModelKV, tp_size: int, pp_size: int, storage: StorageConfig) -> str:
    """One line for the launch log: who this deployment's L3 pages are shared with."""
    grid = sharing_grid(model, tp_size, pp_size, storage)
    tps = storage.share_tp or (tp_size,)
    pps = storage.share_pp or (pp_size,)
    text = (
        f"L3 pages are shared with deployments of TP in {sorted(tps)} and PP in {sorted(pps)} "
        f"(head_group={grid.head_group}, layer_partition={grid.layer_partition})"
    )
    if not storage.share_tp or not storage.share_pp:
        text += "; set StorageConfig.share_tp / share_pp to share with other sizes"
    return text


def make_namespace(
    model: ModelKV, grid: Grid, page_size: int, storage: StorageConfig
) -> KVCacheNamespace:
    """The namespace of ``model``'s pages on ``grid`` under ``storage``'s model identity."""
    storage.check_model_id()
    if not storage.model_id:  # a plan without a backend (tests) still needs a namespace
        raise ConfigError(
            "model_id", "", "empty", "name the model so pages of different models never mix"
        )
    return KVCacheNamespace(
        model_id=storage.namespace_model_id,
        dtype=model.dtype,
        page_size=page_size,
        rank_replicated=model.is_mla,
        total_kv_heads=0 if model.is_mla else model.num_kv_heads,
        layer_partition=grid.layer_partition,
        head_group=grid.head_group,
        object_layout=OBJECT_LAYOUT,
    )
