"""The shard actors of a ``ray`` L3 store: their names, where they are placed, how a client
finds or makes them, and the store's shard count (checked by every user)."""

from __future__ import annotations

import logging
from typing import Any, cast

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.l3_shard import PageShard
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import RayStorageOptions

__all__ = [
    "NAMESPACE",
    "candidate_nodes",
    "check_shard_count",
    "existing_shards",
    "is_dropped",
    "mark_dropped",
    "shard_capacity",
    "shard_handle",
    "shard_name",
    "spread_answer",
]

log = logging.getLogger("actors.ray_store")

NAMESPACE = "hicache"  # Ray namespace of the shard actors: every job finds them by name
_Shard = ray.remote(PageShard)


def shard_name(store: str, index: int) -> str:
    """The actor name of shard ``index`` of store ``store`` (in namespace ``hicache``)."""
    return f"hicache-l3-{store}-{index}"


def shard_handle(opts: RayStorageOptions, index: int, num_shards: int) -> Any:
    # Shard i prefers node i (of the nodes alive when it is made), so a store's objects
    # spread over the cluster's object stores; soft: a lost node's shard restarts elsewhere.
    strategy: Any = "DEFAULT"  # never inside the caller's placement group
    nodes = candidate_nodes(opts)
    if nodes and not opts.shard_resources:
        strategy = NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=True)
    return _Shard.options(
        name=shard_name(opts.name, index),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,  # a crashed shard comes back (empty: its objects died with it)
        max_concurrency=8,
        scheduling_strategy=strategy,
        resources=dict(opts.shard_resources),
    ).remote(num_shards, shard_capacity(opts, num_shards))


def shard_capacity(opts: RayStorageOptions, num_shards: int) -> int:
    """The bytes one of ``num_shards`` shards keeps (0: no limit): ``capacity_bytes``, or
    else ``capacity_fraction`` of the cluster's object store memory, split evenly."""
    total = opts.capacity_bytes
    if not total and opts.capacity_fraction:
        memory = ray.cluster_resources().get("object_store_memory", 0)  # type: ignore[no-untyped-call]
        total = int(opts.capacity_fraction * memory)
    if not total:
        log.warning(
            "ray L3 store %r has no byte limit (capacity_bytes and capacity_fraction are 0): "
            "past Ray's object store, Ray spills its pages to local disk",
            opts.name,
        )
    return max(total // num_shards, 1) if total else 0


def candidate_nodes(opts: RayStorageOptions) -> list[str]:
    """Alive nodes that offer the shards' resources, by node id."""
    alive = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    fit = [
        n
        for n in alive
        if all(n["Resources"].get(r, 0) >= a for r, a in opts.shard_resources.items())
    ]
    return sorted(str(n["NodeID"]) for n in fit)


_DROPPED = b"hicache/dropped/"  # GCS key prefix of dropped stores (internal KV)


def mark_dropped(name: str, dropped: bool) -> None:
    """Record (or clear) that store ``name`` was dropped: clients that lose a shard of a
    dropped store do not make it again."""
    from ray.experimental import internal_kv

    key = _DROPPED + name.encode()
    if dropped:
        internal_kv._internal_kv_put(key, b"1", overwrite=True, namespace=NAMESPACE)
    else:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)


def is_dropped(name: str) -> bool:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(_DROPPED + name.encode(), namespace=NAMESPACE) is not None


def existing_shards(name: str, timeout_s: float) -> int | None:
    """The shard count of store ``name`` as its shard 0 reports it within ``timeout_s``;
    None: no such store, or it does not answer (dying, restarting or still starting)."""
    try:
        shard = ray.get_actor(shard_name(name, 0), namespace=NAMESPACE)
    except ValueError:
        return None
    try:
        found = cast(dict[str, int], ray.get(shard.describe.remote(), timeout=timeout_s))
    except RayError:
        return None
    return found["num_shards"]


def check_shard_count(name: str, wanted: int, found: int | None) -> None:
    """Raise ``ConfigError`` when store ``name`` has ``found`` shards and ``wanted`` is
    another count (0 joins the store's own count; None: the store is not known)."""
    if found is not None and wanted and found != wanted:
        raise ConfigError(
            "ray.num_shards",
            wanted,
            f"store {name!r} was created with {found} shards",
            "use the store's shard count (or 0 to join it), or another ray.name",
        )


def spread_answer(answer: Any, n: int) -> list[Any]:
    """A shard's per-key answer, or its failure repeated for each of its ``n`` keys."""
    return [answer] * n if isinstance(answer, Exception) else list(answer)
