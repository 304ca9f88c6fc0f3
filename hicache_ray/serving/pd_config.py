"""A prefill/decode pair's settings: two deployments of one model over one L3 store.

:meth:`PDConfig.pair` builds both sides from one deployment's settings (the usual way);
building a :class:`PDConfig` directly checks that the two sides can hand pages to each
other: the same model, page size and L3 store settings, each side's TP and PP size among
the store's ``share_tp`` / ``share_pp``, and different names.
"""

from __future__ import annotations

import msgspec

from hicache_ray.base.config import CacheConfig
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.serving.pd_split import MAX_PREFILL_REPLICAS, SplitPolicy

__all__ = ["PDConfig"]


def _store(config: DeploymentConfig) -> StorageConfig:
    """What names and finds the pages (fault-injection rules aside)."""
    return msgspec.structs.replace(config.cache.storage, faults=(), fault_seed=0)


def _shared(sizes: tuple[int, ...], *more: int) -> tuple[int, ...]:
    return tuple(sorted(set(sizes) | set(more)))


class PDConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill deployment, a decode deployment and the split policy between them.

    Attributes:
        prefill: the prefill side (any TP x PP the store shares).
        decode: the decode side.
        policy: when a request is prefilled apart, and how long decode waits for it.
        prefill_replicas: deployments of the prefill side, 1 to 64, each as ``prefill``
            (named ``{prefill.name}-{i}`` when more than one): :meth:`prefill_sides`.
    """

    prefill: DeploymentConfig
    decode: DeploymentConfig
    policy: SplitPolicy = msgspec.field(default_factory=SplitPolicy)
    prefill_replicas: int = 1

    def __post_init__(self) -> None:
        for side in ("prefill", "decode"):
            given = type(getattr(self, side)).__name__
            if not isinstance(getattr(self, side), DeploymentConfig):
                raise ConfigError(side, given, "wrong type", "give a DeploymentConfig")
        if not isinstance(self.policy, SplitPolicy):
            raise ConfigError("policy", self.policy, "wrong type", "give a SplitPolicy")
        replicas = self.prefill_replicas
        if type(replicas) is not int or not 1 <= replicas <= MAX_PREFILL_REPLICAS:
            raise ConfigError(
                "prefill_replicas", replicas, f"outside [1, {MAX_PREFILL_REPLICAS}]", "use 1"
            )
        p, d = self.prefill, self.decode
        if d.name in {p.name, *(side.name for side in self.prefill_sides())}:
            raise ConfigError("decode.name", d.name, "same as the prefill side's", "name each side")
        if p.cache.storage.backend == "none":
            raise ConfigError(
                "storage.backend", "none", "the sides hand pages over through L3", "use ray or file"
            )
        if p.model != d.model:
            raise ConfigError("decode.model", d.model.name, "not the prefill side's", "use one")
        if p.cache.memory.page_size != d.cache.memory.page_size:
            raise ConfigError(
                "decode.page_size",
                d.cache.memory.page_size,
                f"prefill's is {p.cache.memory.page_size}",
                "use one page size (pages are named by their tokens)",
            )
        least = self.policy.min_uncached_tokens
        if d.cache.prefetch.threshold_tokens > least:
            raise ConfigError(
                "decode.prefetch.threshold_tokens",
                d.cache.prefetch.threshold_tokens,
                f"above the policy's min_uncached_tokens ({least}): a prompt handed off "
                "shorter than it would not be read from L3",
                f"use at most {least} (PDConfig.pair does)",
            )
        if _store(p) != _store(d):
            raise ConfigError(
                "decode.storage",
                d.cache.storage.backend,
                "differs from the prefill side's",
                "give both sides the same storage settings (PDConfig.pair does; only the "
                "fault-injection rules may differ)",
            )

    def prefill_sides(self) -> list[DeploymentConfig]:
        """The prefill replicas' settings: ``prefill`` itself when there is one."""
        if self.prefill_replicas == 1:
            return [self.prefill]
        name = self.prefill.name
        return [
            msgspec.structs.replace(self.prefill, name=f"{name}-{i}")
            for i in range(self.prefill_replicas)
        ]

    @classmethod
    def pair(
        cls,
        base: DeploymentConfig,
        *,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        prefill_pp: int = 1,
        decode_pp: int = 1,
        policy: SplitPolicy | None = None,
        prefill_replicas: int = 1,
    ) -> PDConfig:
        """Both sides from ``base`` (named ``{name}-prefill`` and ``{name}-decode``; the
        prefill side ``prefill_replicas`` times), with
        their TP and PP sizes added to the store's ``share_tp`` and ``share_pp``, and the
        decode side's L3 lookup threshold at most the policy's ``min_uncached_tokens``."""
        storage = base.cache.storage
        storage = msgspec.structs.replace(
            storage,
            share_tp=_shared(storage.share_tp, prefill_tp, decode_tp),
            share_pp=_shared(storage.share_pp, prefill_pp, decode_pp),
        )
        policy = policy or SplitPolicy()
        cache = msgspec.structs.replace(base.cache, storage=storage)
        # The decode side looks up every prompt handed to it in L3.
        prefetch = base.cache.prefetch
        least = min(prefetch.threshold_tokens, policy.min_uncached_tokens)
        prefetch = msgspec.structs.replace(prefetch, threshold_tokens=least)

        def side(name: str, tp: int, pp: int, cache: CacheConfig) -> DeploymentConfig:
            return msgspec.structs.replace(
                base, name=f"{base.name}-{name}", tp_size=tp, pp_size=pp, cache=cache
            )

        return cls(
            prefill=side("prefill", prefill_tp, prefill_pp, cache),
            decode=side(
                "decode", decode_tp, decode_pp, msgspec.structs.replace(cache, prefetch=prefetch)
            ),
            policy=policy,
            prefill_replicas=prefill_replicas,
        )
