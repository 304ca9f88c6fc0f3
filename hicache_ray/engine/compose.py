"""A rank composed in one place: its groups, cache controller, model shard and runtime, from
the deployment's config and where the rank sits. Ray-free: ``RankActor`` hosts what this
returns, and tests, benchmarks and engines that embed the library call it directly.

Groups: the cache-consensus group over every rank (gloo), the model's TP group of the
rank's stage and, with more than one rank, a group over every rank for the stage pipe (NCCL
on CUDA, gloo on CPU). All meet on the TCP store that rank 0 binds
(:func:`~hicache_ray.cache.controller.start_rendezvous`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.cache.controller import CacheController, GlooConsensus
from hicache_ray.cache.controller.consensus import Rendezvous
from hicache_ray.engine.model import ReferenceModel, gloo_tp_all_reduce
from hicache_ray.engine.model.groups import model_backend, model_group
from hicache_ray.engine.model.pipe import StageExecutor
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.keys import plan_shard
from hicache_ray.storage import ObjectStore, PagedBackend

__all__ = ["ComposedRank", "RankPlace", "compose_rank", "rank_device"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits: its index (``pp * tp_size + tp``), the device of its pools and
    model, the ``(host, port)`` of the store its groups meet on (None: a deployment of one
    rank in this process, without groups; the controller agrees with itself), rank 0's
    :class:`Rendezvous` on that store, and the generation of the deployment's forming (it
    names the groups, so a re-formed deployment never meets the old one)."""

    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    meet: tuple[str, int] | None = None
    rendezvous: Rendezvous | None = None
    generation: int = 0


@dataclass
class ComposedRank:
    """What :func:`compose_rank` built; :meth:`close` ends the controller and the groups."""

    controller: CacheController
    runtime: RankRuntime
    model_backend: str  # gloo or nccl
    groups: list[GlooConsensus] = field(default_factory=list)

    def close(self) -> None:
        self.controller.close()
        for group in self.groups:
            group.close()


def rank_device(config: DeploymentConfig) -> torch.device:
    """CUDA when the deployment reserves GPUs and this process sees one, else the CPU."""
    return torch.device("cuda" if config.gpus_per_rank and torch.cuda.is_available() else "cpu")


def compose_rank(
    config: DeploymentConfig,
    place: RankPlace | None = None,
    *,
    objects: ObjectStore | None = None,
    **runtime: Any,
) -> ComposedRank:
    """Join this rank's groups (blocks until every rank of the deployment joins), then build
    its controller, model shard and runtime.

    Args:
        place: where the rank sits; None: the one rank of a deployment, on the CPU.
        objects: an object store for this rank's L3 in place of the one the config's
            backend opens (tests and benchmarks share one in-process store between ranks);
            pages stay verified by a :class:`~hicache_ray.storage.PagedBackend`.
        runtime: more :class:`RankRuntime` options (``keep_logits``).
    """
    cfg, place = config, place or RankPlace()
    if place.meet is None and cfg.world_size != 1:
        raise ValueError(f"the {cfg.world_size} ranks of a deployment need a store to meet on")
    groups = _RankGroups(cfg, place)
    tp_rank, pp_rank = place.rank % cfg.tp_size, place.rank // cfg.tp_size
    shard = Shard(tp_rank=tp_rank, tp_size=cfg.tp_size, pp_rank=pp_rank, pp_size=cfg.pp_size)
    kv = ShardKV(model=cfg.model.model_kv(), shard=shard, page_size=cfg.cache.memory.page_size)
    storage = None
    if objects is not None:
        storage = PagedBackend(
            cfg.cache.storage.backend, objects, plan_shard(kv, cfg.cache), scan_on_start=False
        )
    controller = CacheController(
        cfg.cache,
        kv,
        consensus=groups.consensus,
        storage=storage,
        device=place.device,
        host_budget_bytes=cfg.host_budget_bytes or None,
    )
    if place.rank == 0:  # every rank's tree is the same: rank 0's journal tells them all
        controller.publish_events()
    model = ReferenceModel(cfg.model, shard, tp_all_reduce=groups.tp_reduce, device=place.device)
    executor = StageExecutor(
        *(model, place.rank, cfg.tp_size, cfg.pp_size),
        pipe_group=groups.pipe,
        comm_device=place.device if groups.backend == "nccl" else torch.device("cpu"),
    )
    rt = RankRuntime(
        controller,
        model,
        executor=executor,
        reuse_prefix=cfg.reuse_prefix,
        scheduler=cfg.scheduler,
        **runtime,
    )
    return ComposedRank(controller, rt, groups.backend, groups.closable)


class _RankGroups:
    """The groups of one rank (none without a store to meet on)."""

    def __init__(self, cfg: DeploymentConfig, place: RankPlace) -> None:
        self.consensus: GlooConsensus | None = None
        self.tp_reduce: Any = None
        self.pipe: Any = None
        self.closable: list[GlooConsensus] = []
        # The model's own groups: NCCL on CUDA, gloo on CPU (the consensus stays on gloo).
        self.backend = model_backend(place.device)
        if place.meet is None:
            return
        (host, port), rank, tag = place.meet, place.rank, f"g{place.generation}"
        meet = place.rendezvous if rank == 0 else None
        self.consensus = GlooConsensus(
            *(rank, cfg.world_size, host, port),
            timeout_s=cfg.consensus_timeout_s,
            name=f"{tag}-cache",
            rendezvous=meet,
        )
        self.closable.append(self.consensus)
        log.info("rank %d: model collectives on %s (device %s)", rank, self.backend, place.device)

        def group(name: str, group_rank: int, size: int) -> Any:
            return model_group(
                *(self.backend, group_rank, size, host, port),
                name=f"{tag}-{name}",
                timeout_s=cfg.collective_timeout_s,
                rendezvous=meet,
            )

        tp_rank, pp_rank = rank % cfg.tp_size, rank // cfg.tp_size
        if cfg.tp_size > 1:
            self.tp_reduce = gloo_tp_all_reduce(group(f"tp{pp_rank}", tp_rank, cfg.tp_size))
        if cfg.world_size > 1:  # hidden states between stages, the sampled tokens to all
            self.pipe = group("pipe", rank, cfg.world_size)
