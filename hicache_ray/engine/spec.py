"""What a deployment is made of: its shape, model, cache and the limits of its collectives."""

from __future__ import annotations

import msgspec

from hicache_ray.base.affinity import check_cores
from hicache_ray.base.checks import (
    check_custom_resources,
    check_not_negative,
    check_positive,
    check_types,
)
from hicache_ray.base.config import CacheConfig, SchedulerConfig
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import Shard, ShardKV, host_pool_pages
from hicache_ray.base.storage_config import is_plain_name
from hicache_ray.engine.model import ModelConfig, preset
from hicache_ray.engine.model.checkpoint import resolve_model
from hicache_ray.keys import describe_sharing, plan_objects

__all__ = ["DeploymentConfig"]


class DeploymentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One TP x PP deployment of a model with its cache.

    Attributes:
        name: names its placement groups (``{name}-pp{stage}``) and tags its metrics;
            unique among the deployments running in one cluster.
        model: the model: a :class:`ModelConfig`, or a preset name or the path of a Hugging
            Face checkpoint directory (resolved here; every rank loads the same weights).
        tp_size, pp_size: tensor- and pipeline-parallel sizes; rank = pp * tp_size + tp.
        cache: every rank's cache settings (pools, write and prefetch policies, L3).
        scheduler: how ranks batch requests (step token budget, running and queue bounds).
        cpus_per_rank: CPUs each rank reserves; its torch threads are set to this.
        cpu_cores: host cores (Linux CPU numbers) every rank's process runs on, all its
            threads; empty: any core. Ray reserves CPUs by count, not by core, so this is
            how two deployments on one node stay off each other's cores (``bench pd``
            pins its two sides apart). A core the rank's host lacks fails its start.
        gpus_per_rank: 1 on GPU clusters (the pools and the model then live on CUDA), 0 on
            CPU-only ones.
        bundle_resources: more resources each rank's bundle asks for: custom node resources
            (``{"tp4_pool": 1}``) place the deployment on the nodes that offer them.
        host_budget_bytes: host memory each rank may pin for its L2 pool; 0 lets the cache
            size it from the host's free memory.
        consensus_timeout_s: how long a cache-consensus collective waits for a peer before
            the step fails (naming the rank) and the deployment re-forms.
        collective_timeout_s: the same for the model's TP all-reduces and PP transfers.
        placement_timeout_s: how long placing the ranks may take.
        idle_step_s: while nothing is in flight, rank 0 still steps this often (progressing
            background acknowledgements; below ``consensus_timeout_s``).
        max_retries: how many times a request is retried after its ranks failed.
        reuse_prefix: serve cached prefixes; False recomputes every prompt (a no-cache
            baseline with the same code path).
    """

    name: str = "hicache"
    model: ModelConfig = msgspec.field(default_factory=lambda: preset("tiny"))
    tp_size: int = 1
    pp_size: int = 1
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    cpus_per_rank: float = 1.0
    cpu_cores: tuple[int, ...] = ()
    gpus_per_rank: int = 0
    bundle_resources: dict[str, float] = msgspec.field(default_factory=dict)
    host_budget_bytes: int = 0
    consensus_timeout_s: float = 30.0
    collective_timeout_s: float = 300.0
    placement_timeout_s: float = 60.0
    idle_step_s: float = 0.2
    max_retries: int = 2
    reuse_prefix: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.model, str):  # a preset name or a checkpoint directory
            msgspec.structs.force_setattr(self, "model", resolve_model(self.model))
        self._name_checkpoint_pages()
        check_types(self)
        if not is_plain_name(self.name):
            raise ConfigError("name", self.name, "not a plain name", "use letters, digits, - and _")
        self._check_shape()
        self._check_limits()
        self._check_fits()

    def _name_checkpoint_pages(self) -> None:
        storage = self.cache.storage
        if storage.backend != "none" and self.model.checkpoint and not storage.model_revision:
            # L3 pages of a checkpoint are named by it (its directory name unless a model id
            # is given) and by its revision, so another checkpoint never shares them
            named = msgspec.structs.replace(
                storage,
                model_id=storage.model_id or self.model.name,
                model_revision=self.model.revision,
            )
            msgspec.structs.force_setattr(
                self, "cache", msgspec.structs.replace(self.cache, storage=named)
            )
        self.cache.storage.check_model_id()

    def _check_shape(self) -> None:
        check_positive("tp_size", self.tp_size)
        check_positive("pp_size", self.pp_size)
        for what, size in (
            ("KV heads", self.model.num_kv_heads),
            ("intermediate_size", self.model.intermediate_size),
        ):
            if size % self.tp_size:
                raise ConfigError(
                    "tp_size",
                    self.tp_size,
                    f"does not divide the model's {what} ({size})",
                    "pick a TP size that divides the KV heads and the MLP width",
                )
        if self.model.num_layers < self.pp_size:
            raise ConfigError(
                "pp_size",
                self.pp_size,
                f"exceeds the model's {self.model.num_layers} layers",
                "use at most one stage per layer",
            )

    def _check_limits(self) -> None:
        check_positive("cpus_per_rank", self.cpus_per_rank)
        check_cores("cpu_cores", self.cpu_cores)
        check_not_negative("gpus_per_rank", self.gpus_per_rank)
        check_custom_resources(
            "bundle_resources",
            self.bundle_resources,
            "set CPUs and GPUs with cpus_per_rank / gpus_per_rank",
        )
        check_not_negative("host_budget_bytes", self.host_budget_bytes)
        check_positive("consensus_timeout_s", self.consensus_timeout_s)
        check_positive("collective_timeout_s", self.collective_timeout_s)
        check_positive("placement_timeout_s", self.placement_timeout_s)
        if not 0 < self.idle_step_s < self.consensus_timeout_s:
            raise ConfigError(
                "idle_step_s",
                self.idle_step_s,
                f"must be positive and below consensus_timeout_s={self.consensus_timeout_s}",
                "idle ranks wait in a collective until rank 0's next step",
            )
        if self.max_retries < 0:
            raise ConfigError("max_retries", self.max_retries, "negative", "use 0 for none")

    def _check_fits(self) -> None:
        """Refused here, before anything is placed: pools over the host budget, a key grid
        the model cannot tile."""
        model_kv, page = self.model.model_kv(), self.cache.page_size
        if self.host_budget_bytes:
            # The pools of the stage with the most layers must fit (a CPU device's pool
            # counts too).
            last = Shard(tp_size=self.tp_size, pp_size=self.pp_size, pp_rank=self.pp_size - 1)
            kv = ShardKV(model=model_kv, shard=last, page_size=page)
            host_pool_pages(
                self.cache, kv, self.host_budget_bytes, device_in_host_memory=not self.gpus_per_rank
            )
        if self.cache.storage.backend != "none" and self.cache.storage.key_scheme == "unified":
            for pp_rank in range(self.pp_size):
                shard = Shard(tp_size=self.tp_size, pp_size=self.pp_size, pp_rank=pp_rank)
                kv = ShardKV(model=model_kv, shard=shard, page_size=page)
                plan_objects(kv, self.cache.storage)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def sharing(self) -> str:
        """Who this deployment's L3 pages are shared with (the launch log line)."""
        return describe_sharing(
            self.model.model_kv(), self.tp_size, self.pp_size, self.cache.storage
        )
