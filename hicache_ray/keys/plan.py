"""Which storage objects one rank owns per page, under each key scheme, and the key grammar.

Unified keys (``{page_hash}_{digest}_L{first}-{end}[_H{group}]``, SGLang's scheme) name
*what* an object holds, in the coordinates of the whole model: a half-open layer range on
the namespace's layer grid and a head group on its head grid. A rank owns the objects its
shard covers::

    layers 0..31, layer_partition 16, heads 0..7, head_group 2 (share_tp (2, 4))

                H0 (0-1)  H1 (2-3)  H2 (4-5)  H3 (6-7)
    L0-16       TP4 r0    TP4 r1    TP4 r2    TP4 r3       TP2 r0 = H0+H1, r1 = H2+H3
    L16-32      TP4 r0    TP4 r1    TP4 r2    TP4 r3       PP2 stage 1 = the L16-32 row

so a TP=2 rank's objects are exactly the union of two TP=4 ranks', and a PP=1 rank's the
union of the stages'. A shard that does not tile the grid is refused: storing it would give
other deployments wrong KV, not a miss. Rank-replicated (MLA) KV has no head axis and one
object per layer chunk, written by TP rank 0 only.

Rank-suffix keys (``{page_hash}_{model}_{tp_rank}_{tp_size}[_{pp_size}_{pp_rank}]``) name
the rank instead: one object per page with all of the rank's KV, shared by nobody else.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

import msgspec

from hicache_ray.base.config import CacheConfig
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import ShardKV
from hicache_ray.base.storage_config import KeyScheme, StorageConfig
from hicache_ray.keys.namespace import Grid, KVCacheNamespace, make_namespace, sharing_grid

__all__ = [
    "KEY_SCHEMES",
    "MAX_KEY_CHARS",
    "PAGE_HASH_CHARS",
    "ObjectSpec",
    "PlanKeys",
    "ShardPlan",
    "check_keys",
    "layer_chunks",
    "plan_objects",
    "plan_shard",
]

PAGE_HASH_CHARS = 64  # hex SHA-256
MAX_KEY_CHARS = 255  # a file name on every filesystem we write to
# A page hash, then ``_``-separated parts of letters, digits, ``.``, ``-``: no path
# separator, no ``..`` component, nothing a filesystem or shell reads specially.
_KEY = re.compile(r"[0-9a-f]{64}(?:_[A-Za-z0-9][A-Za-z0-9.-]*)+")
_PAGE_HASH = re.compile(r"[0-9a-f]{64}")


class PlanKeys(tuple[str, ...]):
    """Keys :meth:`ShardPlan.keys_of` made from page hashes it checked: of the key grammar
    by construction, so :func:`check_keys` passes them without a scan (a TP=2 lookup's
    1,028 keys: 0.35 ms, one expression a key, on the L3 hit's lookup and again on its
    read)."""

    __slots__ = ()


def check_keys(keys: Iterable[object]) -> None:
    """Raise ``ValueError`` naming the first key that is not a ``str`` of the key grammar
    (a page hash, then ``_``-separated parts of ``[A-Za-z0-9.-]``, at most 255 characters).
    :class:`PlanKeys` are of it already."""
    if type(keys) is PlanKeys:
        return
    for key in keys:
        if type(key) is not str:
            raise ValueError(f"storage keys are str, got {type(key).__name__}: {key!r:.80}")
        if len(key) > MAX_KEY_CHARS or _KEY.fullmatch(key) is None:
            raise ValueError(
                f"storage key {key!r:.120} is not of the key grammar "
                "(64 hex page hash, then _-separated [A-Za-z0-9.-] parts, <= 255 chars)"
            )


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

    def keys_of(self, page_hashes: Iterable[str]) -> PlanKeys:
        """:meth:`keys` of each page of ``page_hashes``, in order, checked once a page.

        Raises:
            ValueError: a page hash that is not 64 lowercase hex digits, or a suffix of this
                plan that makes no key of the grammar.
        """
        suffixes = _checked_suffixes(tuple(obj.suffix for obj in self.objects))
        out = []
        for page_hash in page_hashes:
            if type(page_hash) is not str or _PAGE_HASH.fullmatch(page_hash) is None:
                raise ValueError(f"page hash {page_hash!r:.80} is not 64 lowercase hex digits")
            out += [f"{page_hash}_{suffix}" for suffix in suffixes]
        return PlanKeys(out)

    def spec_of(self, key: str) -> ObjectSpec | None:
        """The object ``key`` names in this plan, or None when it is not one of this rank's."""
        suffix = key[PAGE_HASH_CHARS + 1 :]
        for obj in self.objects:
            if obj.suffix == suffix:
                return obj
        return None


@functools.lru_cache(maxsize=64)
def _checked_suffixes(suffixes: tuple[str, ...]) -> tuple[str, ...]:
    """``suffixes``, once each makes a key of the grammar (with any page hash)."""
    check_keys([f"{'0' * PAGE_HASH_CHARS}_{suffix}" for suffix in suffixes])
    return suffixes


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


def layer_chunks(kv: ShardKV, layer_partition: int) -> list[tuple[int, int]]:
    """[first, end) global layers of each object row of this rank's stage.

    Raises:
        ConfigError: the stage does not start on the grid, or ends off it before the
            model's last layer.
    """
    lo, hi = kv.layer_range
    n, part = kv.model.num_layers, layer_partition
    if not part:
        return [(lo, hi)]
    if lo % part or (hi % part and hi != n):
        raise ConfigError(
            "share_pp",
            part,
            f"PP stage {kv.shard.pp_rank} holds layers {lo}..{hi - 1}, which do not start "
            f"and end on the {part}-layer grid",
            "declare every PP size that shares the store in share_pp (its own included)",
        )
    return [(a, min(a + part, hi)) for a in range(lo, hi, part)]


def _plan_unified(kv: ShardKV, ns: KVCacheNamespace) -> tuple[str, list[ObjectSpec]]:
    shard = kv.shard
    if shard.attn_cp_size > 1:
        raise ConfigError(
            "key_scheme",
            "unified",
            f"attention context parallelism (attn_cp_size={shard.attn_cp_size}) splits KV by "
            "tokens, which unified keys cannot name",
            "use key_scheme='rank-suffix'",
        )
    digest = ns.digest
    chunks = layer_chunks(kv, ns.layer_partition)
    if kv.model.is_mla:
        specs = [_spec(kv, f"{digest}_L{a}-{b}", (a, b), (0, 1), None) for a, b in chunks]
        return digest, specs
    size, local = ns.head_group, kv.local_heads
    if local % size or kv.first_head % size:
        raise ConfigError(
            "share_tp",
            size,
            f"TP rank {shard.tp_rank} of {shard.tp_size} holds heads {kv.first_head}.."
            f"{kv.first_head + local - 1}, which do not tile groups of {size} heads",
            "declare every TP size that shares the store in share_tp (its own included)",
        )
    specs = []
    for a, b in chunks:  # layer-major, head-minor: SGLang's order
        for h in range(0, local, size):
            group = (kv.first_head + h) // size
            specs.append(_spec(kv, f"{digest}_L{a}-{b}_H{group}", (a, b), (h, h + size), group))
    return digest, specs


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", name).lstrip(".-") or "model"


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


def plan_objects(kv: ShardKV, storage: StorageConfig, grid: Grid | None = None) -> ShardPlan:
    """This rank's storage objects per page on ``grid`` (default: the grid ``storage``'s
    sharing declaration gives this deployment's shape).

    Raises:
        ConfigError: the shard does not tile the namespace grid, or the key settings do not
            fit the model (the message says what to set).
    """
    if grid is None:
        grid = sharing_grid(kv.model, kv.shard.tp_size, kv.shard.pp_size, storage)
    ns = make_namespace(kv.model, grid, kv.page_size, storage)
    tag, specs = KEY_SCHEMES[storage.key_scheme](kv, ns)
    return ShardPlan(scheme=storage.key_scheme, namespace=ns, tag=tag, objects=tuple(specs))


def plan_shard(kv: ShardKV, config: CacheConfig) -> ShardPlan:
    """This rank's storage objects per page under ``config``; call once at start-up."""
    return plan_objects(kv, config.storage)
