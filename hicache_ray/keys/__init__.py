"""Page hashes, the L3 key namespace and the per-rank object plans of each key scheme."""

from hicache_ray.keys.namespace import KVCacheNamespace, make_namespace
from hicache_ray.keys.page_hash import page_hashes, salt_seed
from hicache_ray.keys.plan import KEY_SCHEMES, ObjectSpec, ShardPlan, plan_shard

__all__ = [
    "KEY_SCHEMES",
    "KVCacheNamespace",
    "ObjectSpec",
    "ShardPlan",
    "make_namespace",
    "page_hashes",
    "plan_shard",
    "salt_seed",
]
