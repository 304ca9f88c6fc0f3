"""The life of object-store L3 stores: list, clear, drop (the API behind ``hicache-ray store``).

A store is its ``num_shards`` named detached :class:`~actors.l3_shard.PageShard` actors; it
lives until it is dropped, whatever job made it. Clearing empties it (every object freed, the
shards stay); dropping kills its shards, which frees every object they own (the owner is
gone) and removes the store for good. Runs that make a store for themselves (``bench``,
``demo``, the examples) drop it when they end.
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import cast

import msgspec
import ray

from actors.ray_store import RayObjects
from actors.shards import NAMESPACE, mark_dropped, shard_name
from actors.stats import ShardStats
from hicache_ray.base.storage_config import RayStorageOptions

__all__ = [
    "StoreInfo",
    "clear_store",
    "drop_store",
    "list_stores",
    "set_quotas",
    "store_exists",
    "store_owners",
    "store_stats",
]

_SHARD = re.compile(r"^hicache-l3-(?P<store>.+)-(?P<shard>\d+)$")


class StoreInfo(ShardStats, kw_only=True):
    """One store as its shards report it: their counts summed (:class:`ShardStats`).

    Attributes:
        name: the store's name (``RayStorageOptions.name``).
        shards: shard actors found.
        errors: shards that did not answer, with why.
    """

    name: str
    shards: int
    errors: list[str] = msgspec.field(default_factory=list)


def _shards_by_store() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and (m := _SHARD.match(entry["name"])):
            found.setdefault(m["store"], []).append(entry["name"])
    return found


def list_stores(timeout_s: float = 10.0) -> list[StoreInfo]:
    """Every store in the connected cluster, by name."""
    out = []
    for store, names in sorted(_shards_by_store().items()):
        totals = ShardStats()
        errors: list[str] = []
        for name in sorted(names):
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                totals += cast(ShardStats, ray.get(actor.stats.remote(), timeout=timeout_s))
            except Exception as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        counts = msgspec.to_builtins(totals)
        out.append(StoreInfo(name=store, shards=len(names), errors=errors, **counts))
    return out


def drop_store(name: str, timeout_s: float = 30.0) -> int:
    """Kill every shard of store ``name`` (their objects are freed with them); returns how
    many shards were dropped (0: no such store).

    Raises:
        TimeoutError: a shard is still there after ``timeout_s``.
    """
    mark_dropped(name, True)  # clients that lose a shard now leave it dead
    names = _shards_by_store().get(name, [])
    for actor_name in names:
        with contextlib.suppress(ValueError):  # gone meanwhile
            ray.kill(ray.get_actor(actor_name, namespace=NAMESPACE), no_restart=True)
    deadline = time.monotonic() + timeout_s
    while set(_shards_by_store().get(name, [])) & set(names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"store {name!r}: shards still alive after {timeout_s:g}s")
        time.sleep(0.05)
    return len(names)


def set_quotas(options: RayStorageOptions, quotas: dict[str, int]) -> None:
    """Give store ``options.name`` the L3 quota of each owner (a tenant's tag,
    :func:`hicache_ray.serving.tenants.owner_of`) in bytes, split evenly over its shards
    (keys spread over them by hash); replaces the quotas it had."""
    store = RayObjects(options)
    try:
        n = store.num_shards
        share = {owner: max(1, -(-q // n)) for owner, q in quotas.items() if q > 0}
        for shard in range(n):
            store.call(shard, "set_quotas", share)
    finally:
        store.close()


def store_owners(options: RayStorageOptions) -> dict[str, int]:
    """Bytes store ``options.name`` holds per owner (``""``: pages of no tenant)."""
    store = RayObjects(options)
    out: dict[str, int] = {}
    try:
        for shard in range(store.num_shards):
            for owner, n in store.call(shard, "owners").items():
                out[owner] = out.get(owner, 0) + n
    finally:
        store.close()
    return out


def clear_store(options: RayStorageOptions) -> None:
    """Drop every page of store ``options.name`` (its objects are freed; the shards stay)."""
    store = RayObjects(options)
    try:
        for shard in range(store.num_shards):
            store.call(shard, "clear")
    finally:
        store.close()


def store_stats(options: RayStorageOptions) -> ShardStats:
    """Objects, keys and bytes of store ``options.name``, summed over its shards."""
    store = RayObjects(options)
    total = ShardStats()
    try:
        for shard in range(store.num_shards):
            total += store.call(shard, "stats")
    finally:
        store.close()
    return total


def store_exists(name: str) -> bool:
    """Whether a shard of store ``name`` is alive."""
    try:
        ray.get_actor(shard_name(name, 0), namespace=NAMESPACE)
    except ValueError:
        return False
    return True
