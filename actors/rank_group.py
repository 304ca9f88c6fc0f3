"""One generation of a deployment's rank actors: starting them in their bundles, asking
which ones caused a failure, stopping and killing them. Functions of the ranks they are
given; the :class:`~actors.deployment.Deployment` owns the ranks and the locking."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.peers import rank_name
from actors.rank import RankActor
from actors.stats import RankHealth
from hicache_ray.base.errors import ConfigError
from hicache_ray.engine.spec import DeploymentConfig
from placement.groups import StageGroups

__all__ = [
    "STOP_S",
    "check_launch",
    "check_name_free",
    "find_suspects",
    "kill_ranks",
    "start_ranks",
    "stop_ranks",
]

log = logging.getLogger(__name__)

_Rank = ray.remote(RankActor)
STOP_S = 5.0  # how long stopping waits for each rank's step loop


def check_name_free(name: str, owns_groups: bool) -> None:
    """Raise ``ConfigError`` naming ``name`` when a deployment of that name runs in this
    cluster (its rank actors, or, for a deployment that makes its own placement groups,
    its groups ``{name}-pp{stage}``), before anything of a second one is created."""
    from ray.util import list_named_actors, placement_group_table

    ranks = re.compile(re.escape(f"hicache-{name}-g") + r"\d+-rank\d+")
    taken = any(
        a["namespace"] == "hicache" and ranks.fullmatch(a["name"])
        for a in list_named_actors(all_namespaces=True)
    )
    if owns_groups and not taken:
        groups = re.compile(re.escape(f"{name}-pp") + r"\d+")
        taken = any(
            g.get("state") != "REMOVED" and groups.fullmatch(str(g.get("name", "")))
            for g in placement_group_table().values()
        )
    if taken:
        raise ConfigError(
            "name",
            name,
            "a deployment of this name is running in this cluster",
            "give this deployment another name, or shut the other one down first",
        )


def check_launch(config: DeploymentConfig) -> None:
    """The checks of ``Deployment.launch`` that need the cluster, before it creates
    anything: the name is free, and a ``ray`` L3 store that exists has the shard count
    the config asks for (``ConfigError`` otherwise)."""
    from ray.util import get_current_placement_group

    from actors.shards import check_shard_count, existing_shards

    check_name_free(config.name, owns_groups=get_current_placement_group() is None)
    storage = config.cache.storage
    if storage.backend == "ray":
        found = existing_shards(storage.ray.name, storage.ray.timeout_s)
        check_shard_count(storage.ray.name, storage.ray.num_shards, found)


def start_ranks(cfg: DeploymentConfig, groups: StageGroups, generation: int) -> list[Any]:
    """One rank actor per rank of ``cfg``, each in its bundle, named
    ``hicache-{name}-g{generation}-rank{rank}`` in the Ray namespace ``hicache``."""
    ranks = []
    for rank in range(cfg.world_size):
        pp, tp = divmod(rank, cfg.tp_size)
        bundle = groups.bundle_offsets[pp] + groups.rank_bundles[pp][tp]
        strategy = PlacementGroupSchedulingStrategy(
            groups.groups[pp], placement_group_bundle_index=bundle
        )
        ranks.append(
            _Rank.options(
                num_cpus=cfg.cpus_per_rank,
                num_gpus=cfg.gpus_per_rank,
                scheduling_strategy=strategy,
                name=rank_name(cfg.name, generation, rank),
                namespace="hicache",
            ).remote(cfg, rank, generation)
        )
    return ranks


def find_suspects(
    ranks: list[Any], consensus_timeout_s: float, timeout_s: float = 2.0
) -> list[str]:
    """The ranks that caused a failure, as far as asking them tells: those that do not
    answer (dead or hung), and those stuck outside a step while the others waited in
    its collective (a stalled rank; the others report the timeout, not who stalled)."""
    refs = [actor.health.remote() for actor in ranks]
    found = []
    for rank, ref in enumerate(refs):
        try:
            health: RankHealth = ray.get(ref, timeout=timeout_s)
        except Exception:
            found.append(f"rank {rank} does not answer (dead or hung)")
            continue
        outside = health.outside_step_s
        if health.error is None and outside is not None and outside > consensus_timeout_s / 2:
            found.append(f"rank {rank} stalled outside the step for {outside:.1f} s")
    return found


def stop_ranks(ranks: list[Any], name: str) -> None:
    """Stop the step loops (failing what is pending), kill the ranks, and wait (bounded)
    until they are gone: no thread of theirs touches the L3 store afterwards."""
    if ranks:
        # Every rank first expects its peers to go away; then rank 0's loop (which sets
        # the pace) ends, and the others' collectives end with it.
        try:
            ray.wait(
                [r.request_stop.remote() for r in ranks], num_returns=len(ranks), timeout=STOP_S
            )
            ray.wait([ranks[0].stop.remote()], timeout=STOP_S)
        except Exception as exc:  # a dead rank: nothing to stop
            log.debug("deployment %s: stopping ranks: %s", name, exc)
    kill_ranks(ranks)
    deadline = time.monotonic() + STOP_S
    for actor in ranks:
        while time.monotonic() < deadline:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=0.5)
            except RayActorError:
                break
            except GetTimeoutError:
                continue
            time.sleep(0.02)


def kill_ranks(ranks: list[Any]) -> None:
    for actor in ranks:
        ray.kill(actor, no_restart=True)
