"""Which storage objects one rank owns per page, under each key scheme.

Unified keys (``{page_hash}_{digest}_L{first}-{last}[_H{group}]``) name *what* an object
holds, in the coordinates of the whole model: a layer range on the namespace's layer grid
and a head group on its head grid. A rank owns the objects its shard covers::

    layers  0..31, granule 16, heads 0..7, head_group_size 2 (tp_lcm_size 4)

                H0 (0-1)  H1 (2-3)  H2 (4-5)  H3 (6-7)
    L0-15       TP4 r0    TP4 r1    TP4 r2    TP4 r3       TP2 r0 = H0+H1, r1 = H2+H3
    L16-31      TP4 r0    TP4 r1    TP4 r2    TP4 r3       PP2 stage 1 = the L16-31 row

so a TP=2 rank's objects are exactly the union of two TP=4 ranks', and a PP=1 rank's the
union of the stages'. A shard that does not tile the grid is refused: storing it would give
other deployments wrong KV, not a miss.

Rank-suffix keys (``{page_hash}_{model}_{tp_rank}_{tp_size}[_{pp_size}_{pp_rank}]``) name
the rank instead: one object per page with all of the rank's KV, shared by nobody else.
Rank-replicated (MLA) KV has one key per page (and PP stage), written by TP rank 0 only.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from hicache_ray.config import CacheConfig, KeyScheme
from hicache_ray.errors import ConfigError
from hicache_ray.keys.namespace import KVCacheNamespace, make_namespace
from hicache_ray.layout import ShardKV

__all__ = ["KEY_SCHEMES", "PAGE_HASH_CHARS", "ObjectSpec", "ShardPlan", "plan_shard"]

PAGE_HASH_CHARS = 64  # hex SHA-256


class ObjectSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One object of a page and where its bytes sit in this rank's pools.

    Attributes:
        suffix: the key after the page hash (``{digest}_L0-15_H1``).
        layers: [first, end) global layers it holds.
        head_group: index on the namespace head grid; None for whole-rank or latent KV.
        local_layers: [lo, hi) layers in this rank's pools.
        local_heads: [lo, hi) heads within this rank's local heads.
        shape: ``[L, S, P, H, D]`` of its payload.
        num_bytes: payload bytes.
        writer: this rank stores it (False on TP ranks > 0 for rank-replicated KV).
    """

    suffix: str
    layers: tuple[int, int]
    head_group: int | None
    local_layers: tuple[int, int]
    local_heads: tuple[int, int]
    shape: tuple[int, ...]
    num_bytes: int
    writer: bool


class ShardPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's objects per page under one key scheme and namespace.

    Attributes:
        scheme: key scheme name.
        namespace: the namespace the keys belong to.
        tag: what follows the page hash in every key of this namespace (then ``_`` or the
            end): the digest for unified keys, the model for rank-suffix keys.
        objects: this rank's objects of one page, in layer then head order.
    """

    scheme: KeyScheme
    namespace: KVCacheNamespace
    tag: str
    objects: tuple[ObjectSpec, ...]

    @property
    def digest(self) -> str:
        return self.namespace.digest

    def owns(self, key: str) -> bool:
        """Whether ``key`` belongs to this namespace (for start-up scans)."""
        rest = key[PAGE_HASH_CHARS + 1 :]
        return rest == self.tag or rest.startswith(self.tag + "_")

    def keys(self, page_hash: str) -> list[str]:
        """Keys of this rank's objects of the page named ``page_hash``."""
        return [f"{page_hash}_{obj.suffix}" for obj in self.objects]


def _spec(
    kv: ShardKV, suffix: str, layers: tuple[int, int], heads: tuple[int, int], group: int | None
) -> ObjectSpec:
    first = kv.layer_range[0]
    shape = (layers[1] - layers[0], kv.kv_slots, kv.page_size, heads[1] - heads[0], kv.slot_dim)
    num_bytes = kv.model.itemsize
    for dim in shape:
        num_bytes *= dim
    return ObjectSpec(
        suffix=suffix,
        layers=layers,
        head_group=group,
        local_layers=(layers[0] - first, layers[1] - first),
        local_heads=heads,
        shape=shape,
        num_bytes=num_bytes,
        writer=not kv.model.is_mla or kv.shard.tp_rank == 0,
    )


def _plan_unified(kv: ShardKV, ns: KVCacheNamespace) -> tuple[str, list[ObjectSpec]]:
    shard, n = kv.shard, kv.model.num_layers
    if shard.attn_cp_size > 1:
        raise ConfigError(
            "key_scheme",
            "unified",
            f"attention context parallelism (attn_cp_size={shard.attn_cp_size}) splits KV by "
            "tokens, which unified keys cannot name",
            "use key_scheme='rank-suffix'",
        )
    lo, hi = kv.layer_range
    g = ns.layer_granule
    if lo % g or (hi % g and hi != n):
        raise ConfigError(
            "layer_granule",
            g,
            f"PP stage {shard.pp_rank} holds layers {lo}..{hi - 1}, which do not start and end "
            f"on the {g}-layer grid",
            "set layer_granule to a divisor of every stage boundary",
        )
    digest = ns.digest
    layer_ranges = [(a, min(a + g, n)) for a in range(lo, hi, g)]
    if kv.model.is_mla:
        specs = [_spec(kv, f"{digest}_L{a}-{b - 1}", (a, b), (0, 1), None) for a, b in layer_ranges]
        return digest, specs
    size, local = ns.head_group_size, kv.local_heads
    if local % size or kv.first_head % size:
        raise ConfigError(
            "head_group",
            size,
            f"TP rank {shard.tp_rank} of {shard.tp_size} holds heads {kv.first_head}.."
            f"{kv.first_head + local - 1}, which do not tile groups of {size}",
            "set head_group (or tp_lcm_size) so every TP size that shares divides it evenly",
        )
    whole = size == ns.num_kv_heads
    specs = []
    for a, b in layer_ranges:
        for h in range(0, local, size):
            group = (kv.first_head + h) // size
            suffix = f"{digest}_L{a}-{b - 1}" + ("" if whole else f"_H{group}")
            specs.append(_spec(kv, suffix, (a, b), (h, h + size), None if whole else group))
    return digest, specs


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", name) or "model"


def _plan_rank_suffix(kv: ShardKV, ns: KVCacheNamespace) -> tuple[str, list[ObjectSpec]]:
    s = kv.shard
    model = _safe(ns.model_id)
    suffix = model if kv.model.is_mla else f"{model}_{s.tp_rank}_{s.tp_size}"
    if s.pp_size > 1:
        suffix += f"_{s.pp_size}_{s.pp_rank}"
    if s.attn_cp_size > 1:
        suffix += f"_cp{s.attn_cp_rank}_{s.attn_cp_size}"
    spec = _spec(kv, suffix, kv.layer_range, (0, kv.local_heads), None)
    return model, [spec]


KEY_SCHEMES: dict[str, Callable[[ShardKV, KVCacheNamespace], tuple[str, list[ObjectSpec]]]] = {
    "unified": _plan_unified,
    "rank-suffix": _plan_rank_suffix,
}


def plan_shard(kv: ShardKV, config: CacheConfig) -> ShardPlan:
    """This rank's storage objects per page; call once at start-up.

    Raises:
        ConfigError: the shard does not tile the namespace grid, or the key settings do not
            fit the model (the message says what to set).
    """
    storage = config.storage
    ns = make_namespace(kv, storage, config.memory.layer_granule)
    tag, specs = KEY_SCHEMES[storage.key_scheme](kv, ns)
    return ShardPlan(scheme=storage.key_scheme, namespace=ns, tag=tag, objects=tuple(specs))
