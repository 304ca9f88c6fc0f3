"""Page hashes, the L3 key namespace, the sharing grid and the per-rank object plans."""

from hicache_ray.keys.namespace import (
    OBJECT_LAYOUT,
    Grid,
    KVCacheNamespace,
    describe_sharing,
    make_namespace,
    sharing_grid,
)
from hicache_ray.keys.page_hash import page_hashes, salt_seed
from hicache_ray.keys.plan import (
    KEY_SCHEMES,
    ObjectSpec,
    PlanKeys,
    ShardPlan,
    check_keys,
    layer_chunks,
    plan_objects,
    plan_shard,
)

__all__ = [
    "KEY_SCHEMES",
    "OBJECT_LAYOUT",
    "Grid",
    "KVCacheNamespace",
    "ObjectSpec",
    "PlanKeys",
    "ShardPlan",
    "check_keys",
    "describe_sharing",
    "layer_chunks",
    "make_namespace",
    "page_hashes",
    "plan_objects",
    "plan_shard",
    "salt_seed",
    "sharing_grid",
]
