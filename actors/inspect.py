"""What runs in a cluster: every deployment's ranks and every object-store L3, found by name.

Rank actors are named ``hicache-{deployment}-g{generation}-rank{rank}`` and L3 shards
``hicache-l3-{store}-{shard}``, all in the Ray namespace ``hicache``, so any process
connected to the cluster (``hicache-ray stats``) can find and ask them.
"""

from __future__ import annotations

import re
from typing import Any, cast

import msgspec
import ray

from actors.shards import NAMESPACE
from actors.stats import ShardStats

__all__ = ["cluster_stats", "object_store_summary", "object_store_usage"]

_RANK = re.compile(r"^hicache-(?P<dep>.+)-g(?P<gen>\d+)-rank(?P<rank>\d+)$")
_SHARD = re.compile(r"^hicache-l3-(?P<store>.+)-(?P<shard>\d+)$")


def cluster_stats(timeout_s: float = 10.0) -> dict[str, Any]:
    """``{"deployments": {name: {"generation", "ranks": [{"rank", "health", "stats"}]}},
    "stores": {name: {"shards", "objects", "keys", "bytes", "capacity_bytes",
    "evicted_objects", "quota_evicted_objects", "lost_objects", "adopting"}}}``; a rank or
    shard that does not answer in ``timeout_s`` shows its error instead; and
    ``"object_store"``: :func:`object_store_summary` (spilling included)."""
    ranks: dict[str, dict[int, dict[int, str]]] = {}  # deployment -> generation -> rank -> name
    shards: dict[str, list[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE:
            continue
        name = entry["name"]
        if found := _RANK.match(name):
            gens = ranks.setdefault(found["dep"], {})
            gens.setdefault(int(found["gen"]), {})[int(found["rank"])] = name
        elif found := _SHARD.match(name):
            shards.setdefault(found["store"], []).append(name)
    out: dict[str, Any] = {"deployments": {}, "stores": {}}
    for dep, gens in sorted(ranks.items()):
        generation = max(gens)
        members = []
        for rank, name in sorted(gens[generation].items()):
            members.append({"rank": rank, **_ask(name, timeout_s)})
        out["deployments"][dep] = {"generation": generation, "ranks": members}
    for store, names in sorted(shards.items()):
        counts = ShardStats()
        errors: list[str] = []
        for name in names:
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                counts += cast(ShardStats, ray.get(actor.stats.remote(), timeout=timeout_s))
            except Exception as exc:
                errors.append(f"{name}: {exc!r}")
        total = {"shards": len(names), **msgspec.to_builtins(counts)}
        out["stores"][store] = {**total, "errors": errors} if errors else total
    try:
        out["object_store"] = object_store_summary()
    except Exception as exc:  # Ray's summary is not public API: say so, do not fail
        out["object_store"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def object_store_usage() -> tuple[int, int]:
    """(MiB, objects) in the object stores of the connected cluster (Ray's summary)."""
    summary = object_store_summary()
    return summary["used_mib"], summary["objects"]


def object_store_summary() -> dict[str, int]:
    """The connected cluster's object stores as Ray sums them: ``used_mib``, ``objects``,
    and ``spilled_mib`` (spilled to disk since the cluster started, by anyone)."""
    from ray._private.internal_api import memory_summary

    # the connected cluster's address: without it Ray reads a possibly stale cluster file
    address = ray.get_runtime_context().gcs_address
    summary: str = memory_summary(address, stats_only=True)  # type: ignore[no-untyped-call]
    found = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", summary)
    if found is None:
        raise RuntimeError("Ray's object store summary changed its format")
    spilled = re.search(r"Spilled (\d+) MiB", summary)
    return {
        "used_mib": int(found.group(1)),
        "objects": int(found.group(2)),
        "spilled_mib": int(spilled.group(1)) if spilled else 0,
    }


def _ask(name: str, timeout_s: float) -> dict[str, Any]:
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
        answers: list[Any] = ray.get(
            [actor.health.remote(), actor.stats.remote()], timeout=timeout_s
        )
        return {"health": msgspec.to_builtins(answers[0]), "stats": msgspec.to_builtins(answers[1])}
    except Exception as exc:
        return {"health": {"stepping": False, "error": repr(exc)}, "stats": None}
