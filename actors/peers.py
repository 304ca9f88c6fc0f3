"""How a rank finds the other ranks of its generation (named actors), and rank 0's
look-ahead hints to them (:mod:`hicache_ray.engine.hints`)."""

from __future__ import annotations

import logging

import ray

from hicache_ray.engine.hints import Tell
from hicache_ray.engine.spec import DeploymentConfig

__all__ = ["peer_teller", "rank_name"]

log = logging.getLogger(__name__)


def rank_name(name: str, generation: int, rank: int) -> str:
    """The Ray name (namespace ``hicache``) of rank ``rank`` of a deployment's generation."""
    return f"hicache-{name}-g{generation}-rank{rank}"


def peer_teller(cfg: DeploymentConfig, generation: int) -> Tell | None:
    """Rank 0's way to hand a look-ahead hint to every other rank of its generation (each
    a call it does not wait for); None for a single rank, or when a peer is not found
    (then each rank looks up at admission, as without hints)."""
    if cfg.world_size < 2:
        return None
    try:
        peers = [
            ray.get_actor(rank_name(cfg.name, generation, rank), namespace="hicache")
            for rank in range(1, cfg.world_size)
        ]
    except ValueError as exc:
        log.warning("deployment %s: no look-ahead hints to the other ranks: %s", cfg.name, exc)
        return None

    def tell(key: bytes, cache_salt: str, start: int, step: int) -> None:
        for peer in peers:
            peer.look_ahead.remote(key, cache_salt, start, step)

    return tell
