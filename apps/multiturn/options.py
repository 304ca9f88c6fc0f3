"""Options of ``hicache-ray demo`` and ``bench multiturn``: workload, capacities, policies
(light: the CLI reads their defaults for ``--help``; the model loads on use)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from apps.multiturn.trace import Lengths, Trace, TraceConfig
from hicache_ray.base.config import (
    CacheConfig,
    MemoryConfig,
    PrefetchConfig,
    PrefetchPolicy,
    WriteConfig,
    WritePolicy,
)
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import FileStorageOptions, RayStorageOptions, StorageConfig

__all__ = ["MODES", "ExperimentOptions"]

MODES = ("none", "l1", "l1_l2", "l1_l2_l3")


@dataclass(frozen=True)
class ExperimentOptions:
    """Workload, capacities and policies of the demo and the benchmark (CLI flags)."""

    clients: int = 12
    rounds: int = 3  # bench: all rounds; demo: the TP=2 rounds
    continue_rounds: int = 2  # demo: rounds continued on TP=4
    # A system prompt of realistic length: prefill dominates a request as it does in
    # serving (with 256 tokens the collectives' fixed cost of a step hid the saving at TP=4)
    system_len: int = 1024
    user: str = "64-96"
    answer: str = "16-32"
    rate: float = 0.0
    concurrency: int = 2
    model: str = "bench"
    page_size: int = 16
    device_tokens: int = 4096
    host_ratio: float = 1.5
    storage: str = "ray"  # ray | file
    storage_root: str = ""
    write_policy: WritePolicy = "write_through"
    prefetch_policy: PrefetchPolicy = "wait_complete"
    # 0: every page past the L2 hit is looked up in L3 (the oracle of bench multiturn and
    # the demo then sees every L3 hit); bench serve uses the product default (256)
    prefetch_threshold: int = 0
    tp_size: int = 1
    pp_size: int = 1
    modes: tuple[str, ...] = MODES
    check: int = 4  # requests re-run from scratch for the exactness check
    seed: int = 0
    store: str = field(default_factory=lambda: f"run-{os.getpid()}")
    keep_store: bool = False  # leave the run's ray store alive (else it is dropped at the end)

    def validate(self, *, tp_sizes: tuple[int, ...] = ()) -> None:
        """Raise :class:`ConfigError` naming the first bad option; cheap, starts nothing
        (the CLI runs it before Ray). ``tp_sizes``: the TP sizes the run will deploy
        (default: ``tp_size``)."""
        for name in ("clients", "rounds", "concurrency", "tp_size", "pp_size", "page_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be 1 or more", "raise it")
        for name in ("continue_rounds", "system_len", "check", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "negative", "use 0 or more")
        if not self.rate >= 0:
            raise ConfigError("rate", self.rate, "negative", "use 0 (closed loop) or more")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ConfigError("modes", self.modes, "unknown or empty", f"choose from {MODES}")
        user, answer = Lengths.parse(self.user, "user"), Lengths.parse(self.answer, "answer")
        turns = self.rounds + self.continue_rounds
        longest = self.system_len + turns * ((user.high or user.low) + (answer.high or answer.low))
        if self.device_tokens < longest:
            raise ConfigError(
                "device_tokens",
                self.device_tokens,
                f"cannot hold the longest request of this workload ({longest} tokens: the "
                f"system prompt and {turns} turns)",
                f"give at least {longest}, or shorten the conversations",
            )
        cache = self.cache()  # policies, page size, capacities, storage options
        for tp in tp_sizes or (self.tp_size,):
            self.deployment("check", cache, tp_size=tp)  # TP / PP against the model

    def trace(self, rounds: int) -> Trace:
        from hicache_ray.engine.model import preset

        model = preset(self.model)
        return Trace(
            TraceConfig(
                clients=self.clients,
                rounds=rounds,
                system_len=self.system_len,
                user=Lengths.parse(self.user, "user"),
                answer=Lengths.parse(self.answer, "answer"),
                rate=self.rate,
                vocab=model.vocab_size,
                seed=self.seed,
            )
        )

    def cache(self) -> CacheConfig:
        storage = StorageConfig(
            backend=self.storage,
            model_id=f"reference/{self.model}",
            share_tp=(1, 2, 4),  # TP=4 ranks of 4-head models own one KV head per object
            ray=RayStorageOptions(name=self.store),
            file=FileStorageOptions(root=self.storage_root, scan_on_start=False),
        )
        return CacheConfig(
            memory=MemoryConfig(
                page_size=self.page_size,
                device_tokens=self.device_tokens,
                hicache_ratio=self.host_ratio,
            ),
            write=WriteConfig(policy=self.write_policy),
            prefetch=PrefetchConfig(
                policy=self.prefetch_policy,
                threshold_tokens=self.prefetch_threshold,
            ),
            storage=storage,
        )

    def deployment(self, name: str, cache: CacheConfig, **kw: Any) -> Any:
        """The ``actors.DeploymentConfig`` of one deployment of this run."""
        from hicache_ray.engine.model import preset
        from hicache_ray.engine.spec import DeploymentConfig

        base = {"tp_size": self.tp_size, "pp_size": self.pp_size, **kw}
        return DeploymentConfig(name=name, model=preset(self.model), cache=cache, **base)
