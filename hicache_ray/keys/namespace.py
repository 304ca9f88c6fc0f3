"""The KV cache namespace: everything that must match for two ranks to share a page.

A page key carries a short digest of the namespace, so deployments that differ in any of
these facts (model, revision, dtype, page size, head grouping, layer granule, object
layout, tenant) never read each other's bytes; a rank that finds a foreign digest in a
page header treats the page as a miss.
"""

from __future__ import annotations

import hashlib
import logging
import math

import msgspec

from hicache_ray.config import StorageConfig
from hicache_ray.errors import ConfigError
from hicache_ray.layout import ShardKV

__all__ = ["NAMESPACE_SCHEMA_VERSION", "OBJECT_LAYOUT", "KVCacheNamespace", "make_namespace"]

log = logging.getLogger(__name__)

NAMESPACE_SCHEMA_VERSION = 1
# Bytes of one object: [layers, slots (K, V | latent), tokens of the page, heads, dim].
OBJECT_LAYOUT = "LSPHD"


class KVCacheNamespace(msgspec.Struct, frozen=True, kw_only=True):
    """Frozen identity of a shared page space; its msgpack encoding is hashed into keys.

    Attributes:
        schema_version: bumped when the meaning of any field changes.
        model_id, revision: which weights produced the KV.
        dtype: logical dtype of the stored KV.
        page_size: tokens per page.
        rank_replicated: every TP rank holds the same KV (MLA); one copy is stored.
        num_kv_heads: total KV heads of the model (1 for MLA).
        head_group_size: KV heads per object.
        layer_granule: layers per object (the last object of the model may hold fewer).
        object_layout: byte order inside an object.
        tenant_salt: the tenant whose prompts seeded the page hashes.
    """

    schema_version: int = NAMESPACE_SCHEMA_VERSION
    model_id: str
    revision: str
    dtype: str
    page_size: int
    rank_replicated: bool
    num_kv_heads: int
    head_group_size: int
    layer_granule: int
    object_layout: str = OBJECT_LAYOUT
    tenant_salt: str = ""

    @property
    def digest(self) -> str:
        """16 hex characters of SHA-256 over the msgpack encoding (stable across processes)."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]


def stage_boundaries(kv: ShardKV) -> list[int]:
    """First layer of every PP stage, then the number of layers."""
    n, p = kv.model.num_layers, kv.shard.pp_size
    base, extra = divmod(n, p)
    return [r * base + min(r, extra) for r in range(p)] + [n]


def resolve_layer_granule(kv: ShardKV, layer_granule: int) -> int:
    """``layer_granule`` or, when 0, the largest granule every PP stage boundary sits on."""
    if layer_granule:
        return layer_granule
    return math.gcd(*stage_boundaries(kv))


def _head_group_size(kv: ShardKV, storage: StorageConfig) -> int:
    model, tp = kv.model, kv.shard.tp_size
    if model.is_mla:
        return 1
    total = model.num_kv_heads
    if storage.head_group:
        if total % storage.head_group:
            raise ConfigError(
                "head_group",
                storage.head_group,
                f"does not divide num_kv_heads={total}",
                f"use a divisor of {total}",
            )
        return storage.head_group
    if kv.local_heads == 1 and tp > 1:
        raise ConfigError(
            "head_group",
            0,
            f"each of the {tp} TP ranks holds one KV head, so whether larger TP sizes would "
            "replicate or split it is ambiguous",
            "set head_group explicitly (1 to store each head on its own)",
        )
    if storage.tp_lcm_size:
        lcm = storage.tp_lcm_size
        if lcm % tp:
            raise ConfigError(
                "tp_lcm_size",
                lcm,
                f"not a multiple of this tp_size={tp}",
                "use lcm of all TP sizes",
            )
        if total % lcm:
            raise ConfigError(
                "tp_lcm_size",
                lcm,
                f"does not divide num_kv_heads={total}",
                "set head_group explicitly to a divisor of the KV heads",
            )
        return total // lcm
    log.info(
        "L3 namespace shares pages only with TP=%d deployments; set tp_lcm_size (or head_group) "
        "to share them across TP sizes",
        tp,
    )
    return kv.local_heads


def make_namespace(kv: ShardKV, storage: StorageConfig, layer_granule: int = 0) -> KVCacheNamespace:
    """The namespace of ``kv``'s model under ``storage``'s key settings.

    Raises:
        ConfigError: ``head_group`` or ``tp_lcm_size`` do not fit the model's KV heads, or
            one KV head per rank leaves the split ambiguous.
    """
    model = kv.model
    return KVCacheNamespace(
        model_id=storage.model_id,
        revision=storage.model_revision,
        dtype=model.dtype,
        page_size=kv.page_size,
        rank_replicated=model.is_mla,
        num_kv_heads=1 if model.is_mla else model.num_kv_heads,
        head_group_size=_head_group_size(kv, storage),
        layer_granule=resolve_layer_granule(kv, layer_granule),
        tenant_salt=storage.tenant_salt,
    )
