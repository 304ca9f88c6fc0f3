"""The cache controller: consensus across ranks and the write/load/prefetch/backup pipelines."""

from hicache_ray.cache.controller.claim import PrefixClaim
from hicache_ray.cache.controller.consensus import (
    Consensus,
    ConsensusError,
    GlooConsensus,
    LocalConsensus,
    Rendezvous,
    start_rendezvous,
)
from hicache_ray.cache.controller.controller import CacheController, StepResult
from hicache_ray.cache.controller.protocol import Arrival

__all__ = [
    "Arrival",
    "CacheController",
    "Consensus",
    "ConsensusError",
    "GlooConsensus",
    "LocalConsensus",
    "PrefixClaim",
    "Rendezvous",
    "StepResult",
    "start_rendezvous",
]
